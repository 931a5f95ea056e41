"""Tiny randomly initialised hybrid targets (Gated DeltaNet + full attention), float64 on CPU,
and the reference they must match: the model's own forward, one token at a time.

    python -m tests.hybrid_models FOLDER    # a tiny Qwen3.5 hybrid folder the app and bench can load
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import DynamicCache, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

from engine.decode import Decoder, DrafterInfo
from engine.target import Target, bundled_gguf
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
        return Qwen3NextConfig(**shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2,
                               shared_expert_intermediate_size=hidden_size // 2, decoder_sparse_step=1,
                               mlp_only_layers=[i for i in range(len(layer_types)) if i != 2],
                               experts_implementation="eager")
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


def save_tiny_hybrid(folder: str | Path, family: str = "qwen3_5", seed: int = 0) -> Path:
    """A random hybrid with SmolLM2's tokenizer (and vocabulary size), saved like any HF model folder."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    # eos <|im_end|> (2): the chat end-of-turn of SmolLM2's template; untied head, as in Qwen3.5
    model = hybrid_model(family, seed, vocab=49152, tie_word_embeddings=False, eos_token_id=2)
    model.save_pretrained(folder)
    gguf = bundled_gguf()
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder)
    return folder


if __name__ == "__main__":
    print(save_tiny_hybrid(sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3.5-hybrid"))
