"""Turn a GGUF target (the bundled SmolLM2 is Q4_1) into a plain HF folder that vLLM and
transformers load: weights dequantized to bf16 safetensors, config.json, tokenizer.

    python -m engine.training.convert /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol-hf

``save_pretrained`` refuses GGUF-quantized models, hence the manual save. A tied lm_head
is left out (the config's tie_word_embeddings restores it). Needs the ``gguf`` package.
"""

from __future__ import annotations

import argparse
import json
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    convert(args.gguf, args.out, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
