"""Turn a GGUF target (the bundled SmolLM2 is Q4_1) into a plain HF folder that vLLM and
transformers load: weights dequantized to bf16 safetensors, config.json, tokenizer.

    python -m engine.models.convert /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol-hf

``save_pretrained`` refuses GGUF-quantized models, hence the manual save. A tied lm_head
is left out (the config's tie_word_embeddings restores it). Needs the ``gguf`` package.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def convert(gguf: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    tied = model.config.tie_word_embeddings
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()
             if not (tied and name == "lm_head.weight")}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are no longer quantized
    # a GGUF load leaves this empty; vLLM would then map "llama" to the headless LlamaModel
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = DTYPE_NAMES[dtype]  # older readers look for torch_dtype
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    tokenizer.save_pretrained(str(out))
    print(f"convert: {len(state)} tensors ({DTYPE_NAMES[dtype]}) and the tokenizer written to {out}")


def tensor_parallel_copy(source: Path, out: Path, tensor_parallel_size: int) -> None:
    """The same model with attention heads that split over ``tensor_parallel_size`` GPUs.

    vLLM shards query and KV heads evenly; SmolLM2's 9 query / 3 KV heads do not split over 2.
    Each KV head is copied ``c = tp / gcd(kv, tp)`` times and each query group is padded with
    zero heads to a multiple of ``c``: the copies hold the same keys, and a zero head's output
    projection is zero, so every logit is unchanged (up to float summation order). Works on
    a target or a DFlash drafter folder; its other files (tokenizer, ...) are copied as they are.
    """
    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    group, copies = heads // kv_heads, tensor_parallel_size // math.gcd(kv_heads, tensor_parallel_size)
    padded = -(-group // copies) * copies

    def pad_queries(w: torch.Tensor, dim: int) -> torch.Tensor:  # dim: where the heads sit in w
        shape = list(w.shape)
        grouped = w.reshape(shape[:dim] + [kv_heads, group, head_dim] + shape[dim + 1:])
        zeros_shape = list(grouped.shape)
        zeros_shape[dim + 1] = padded - group
        grouped = torch.cat([grouped, grouped.new_zeros(zeros_shape)], dim + 1)
        return grouped.reshape(shape[:dim] + [-1] + shape[dim + 1:]).contiguous()

    def copy_kv(w: torch.Tensor) -> torch.Tensor:
        per_head = w.reshape(kv_heads, 1, head_dim, *w.shape[1:])
        return per_head.expand(kv_heads, copies, *per_head.shape[2:]).reshape(-1, *w.shape[1:]).contiguous()

    weight_files = sorted(source.glob("*.safetensors"))
    state = {name: w for path in weight_files for name, w in load_file(str(path)).items()}
    for name, w in state.items():
        if ".q_proj." in name:
            state[name] = pad_queries(w, 0)
        elif ".k_proj." in name or ".v_proj." in name:
            state[name] = copy_kv(w)
        elif name.endswith("o_proj.weight"):
            state[name] = pad_queries(w, 1)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.update(num_attention_heads=kv_heads * padded, num_key_value_heads=kv_heads * copies, head_dim=head_dim)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    for path in source.iterdir():  # the weights were merged into one file above
        if path.is_file() and path.name != "config.json" and path not in weight_files \
                and not path.name.endswith(".safetensors.index.json"):
            shutil.copy2(path, out / path.name)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    convert(args.gguf, args.out, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
