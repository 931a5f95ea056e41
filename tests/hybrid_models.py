"""Tiny randomly initialised hybrid targets (Gated DeltaNet + full attention), float64 on CPU,
and the reference they must match: the model's own forward, one token at a time.

    python -m tests.hybrid_models FOLDER               # a tiny Qwen3.5 hybrid the app and bench load
    python -m tests.hybrid_models FOLDER --vllm-shape  # one at a shape vLLM's kernels take (the GPU check)
    python -m tests.hybrid_models --scripted-drafter OUT --model FOLDER --prompts FILE
        # a drafter that knows FOLDER's own greedy answers to FILE's prompts (engine.models.drafter.ScriptedDrafter)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.settings import DecodeSettings
from engine.models.target import Target, bundled_gguf
from tests.tiny import STOP, CharTokenizer, tiny_drafter

LINEAR, FULL = "linear_attention", "full_attention"
# linear layers on both sides of the attention layer, as in Qwen3.6 (3 linear : 1 full)
LAYER_TYPES = [LINEAR, FULL, LINEAR, LINEAR]
FAMILIES = ("qwen3_5", "qwen3_next")


def hybrid_config(family: str = "qwen3_5", vocab: int = 40, layer_types: list[str] | None = None,
                  hidden_size: int = 32, **overrides):
    layer_types = layer_types or LAYER_TYPES
    shape = dict(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                 num_hidden_layers=len(layer_types), layer_types=layer_types,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 2,
                 linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=hidden_size // 4, linear_value_head_dim=hidden_size // 4,
                 max_position_embeddings=512, eos_token_id=STOP, tie_word_embeddings=True, initializer_range=0.3)
    shape.update(overrides)
    if family == "qwen3_5":
        return Qwen3_5TextConfig(**shape)
    if family == "qwen3_next":
        # one sparse-MoE layer (the others dense); eager experts: the grouped-mm kernel has no float64
        experts = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
                       shared_expert_intermediate_size=hidden_size // 2, decoder_sparse_step=1,
                       mlp_only_layers=[i for i in range(len(layer_types)) if i != 2],
                       experts_implementation="eager")
        return Qwen3NextConfig(**(experts | shape))
    raise ValueError(f"unknown family {family!r}")


def hybrid_model(family: str = "qwen3_5", seed: int = 0, dtype=torch.float64, **config):
    torch.manual_seed(seed)
    config = hybrid_config(family, **config)
    model_class = Qwen3_5ForCausalLM if family == "qwen3_5" else Qwen3NextForCausalLM
    return model_class(config).to(dtype).eval()


def hybrid_target(family: str = "qwen3_5", seed: int = 0, **config) -> Target:
    return Target(model=hybrid_model(family, seed, **config), tokenizer=CharTokenizer(), name=f"tiny-{family}",
                  stop_ids=[STOP])


def hybrid_decoder(family: str = "qwen3_5", seed: int = 0, block_size: int = 16, **config) -> Decoder:
    target = hybrid_target(family, seed, **config)
    return Decoder(target, tiny_drafter(target, seed, block_size), DrafterInfo("random", trained=False))


@torch.inference_mode()
def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int]) -> list[int]:
    """Greedy AR with the model's own forward: the prompt in one pass, then one token per call
    (the single-token recurrent path every hybrid decoding must agree with)."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True).logits[0, -1]
    output: list[int] = []
    while True:
        token = int(logits.argmax())
        output.append(token)
        if token in stop_ids or len(output) == max_new_tokens:
            return output
        position = torch.tensor([[len(prompt_ids) + len(output) - 1]])
        logits = model(input_ids=torch.tensor([[token]]), position_ids=position, cache=cache,
                       use_cache=True).logits[0, -1]


# The GPU check's model is what Qwen3.5 / 3.6 checkpoints are: the multimodal class around the
# hybrid language model (vLLM 0.23 serves Qwen3.5 no other way; it runs it text-only, the torch
# engine loads its language model). Qwen3.5, not Qwen3-Next: vLLM's Qwen3-Next needs an MoE
# layer, and the GPU bundle leaves vLLM's MoE kernels out. Head dims vLLM's kernels take (64 for
# the linear layers, 256 and multimodal rotary positions as in Qwen3.6), room for the vLLM
# engine's 4096-token context, a one-layer vision tower that text-only runs skip, and float32
# recurrent states as Qwen3.5 / 3.6 checkpoints ask of vLLM (``mamba_ssm_dtype``; vLLM's default
# is the model's dtype, and a bf16 state rounds between the tokens one-token decoding stores and a
# tree path replays in one launch).
VLLM_SHAPE = dict(hidden_size=256, head_dim=256, linear_key_head_dim=64, linear_value_head_dim=64,
                  max_position_embeddings=4096, mamba_ssm_dtype="float32",
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                                   "mrope_section": [11, 11, 10], "mrope_interleaved": True})
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
                   spatial_merge_size=2, in_channels=3, num_position_embeddings=64)


def save_tiny_hybrid(folder: str | Path, family: str = "qwen3_5", seed: int = 0, vllm_shape: bool = False,
                     attention_only: bool = False) -> Path:
    """A random hybrid with SmolLM2's tokenizer (and vocabulary size), saved like any HF model folder,
    in float32: a text-only checkpoint, or (``vllm_shape``) a Qwen3.5 one as vLLM serves it (see
    ``VLLM_SHAPE``). ``attention_only``: the same model with every layer full attention, to compare
    costs with."""
    from transformers import AutoTokenizer, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    folder = Path(folder)
    # eos <|im_end|> (2): the chat end-of-turn of SmolLM2's template; untied head, as in Qwen3.5
    shape = dict(vocab=49152, tie_word_embeddings=False, eos_token_id=2) | (VLLM_SHAPE if vllm_shape else {}) \
        | ({"layer_types": [FULL] * len(LAYER_TYPES)} if attention_only else {})
    if vllm_shape:
        text = hybrid_config("qwen3_5", **shape)
        config = Qwen3_5Config(text_config=text.to_dict(),
                               vision_config=TINY_VISION | {"out_hidden_size": text.hidden_size},
                               tie_word_embeddings=False)
        torch.manual_seed(seed)
        model = Qwen3_5ForConditionalGeneration(config).float().eval()
    else:
        model = hybrid_model(family, seed, dtype=torch.float32, **shape)
    model.save_pretrained(folder)
    if vllm_shape:  # a whole Qwen3.5 checkpoint: vLLM loads its image processor unless told text-only
        from transformers import Qwen2VLImageProcessor

        Qwen2VLImageProcessor(patch_size=TINY_VISION["patch_size"],
                              temporal_patch_size=TINY_VISION["temporal_patch_size"],
                              merge_size=TINY_VISION["spatial_merge_size"]).save_pretrained(folder)
    gguf = bundled_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


def scripted_drafter_for(folder: str | Path, target: Target, prompts: list[list[int]], max_new_tokens: int,
                         demote_every: int = 4) -> Path:
    """A ``ScriptedDrafter`` folder holding ``target``'s own greedy answers to ``prompts``
    (its AR run through the Studio's torch engine), shaped to fit ``target``."""
    from engine.models.drafter import fresh_config, write_scripted_drafter

    decoder = Decoder(target, None, DrafterInfo("none", trained=False))
    sequences = [ids + decoder.run(prompt_ids=ids,
                                   settings=DecodeSettings("ar", max_new_tokens=max_new_tokens)).output_ids
                 for ids in prompts]
    config = fresh_config(target.config, num_layers=1, mask_token_id=target.config.vocab_size - 1, num_taps=2)
    return write_scripted_drafter(folder, config, sequences, demote_every)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.hybrid_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", help="where to save a tiny hybrid")
    parser.add_argument("--family", default="qwen3_5", choices=FAMILIES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-shape", action="store_true", help="a shape vLLM's kernels take (head dims 64)")
    parser.add_argument("--attention-only", action="store_true", help="every layer full attention (a cost baseline)")
    parser.add_argument("--scripted-drafter", metavar="OUT", help="write a scripted drafter for --model instead")
    parser.add_argument("--model", help="the hybrid folder the scripted drafter knows the answers of")
    parser.add_argument("--prompts", help="a prompt set (engine.tools.prompt_sets)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    args = parser.parse_args(argv)
    if args.scripted_drafter:
        from engine.models.target import load_target
        from engine.tools.bench import read_prompts

        target = load_target(args.model, dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu")
        prompts = [target.chat_ids(p["prompt"]) for p in read_prompts(args.prompts)[:args.limit]]
        print(scripted_drafter_for(args.scripted_drafter, target, prompts, args.max_new_tokens))
        return 0
    print(save_tiny_hybrid(args.folder or f"tiny-{args.family}-hybrid", args.family, args.seed,
                           vllm_shape=args.vllm_shape, attention_only=args.attention_only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
