"""Tiny randomly initialised models for exactness tests (float64, CPU)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.loop.decode import Decoder, DrafterInfo
from engine.models.drafter import DFlashDrafter, fresh_config
from engine.models.target import Target

VOCAB = 96
STOP = 1


class CharTokenizer:
    """Decodes token i as a printable character; enough for traces and text pieces."""

    chat_template = None
    eos_token_id = STOP
    unk_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(33 + i) for i in ids if not (skip_special_tokens and i == STOP))

    def __call__(self, text):
        return {"input_ids": [ord(c) - 33 for c in text]}


def tiny_target(seed: int = 0, vocab: int = VOCAB, layers: int = 4, dtype=torch.float64) -> Target:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=STOP, tie_word_embeddings=True, initializer_range=0.3)
    model = LlamaForCausalLM(config).to(dtype).eval()
    return Target(model=model, tokenizer=CharTokenizer(), name="tiny-llama", stop_ids=[STOP])


def tiny_drafter(target: Target, seed: int = 0, block_size: int = 16, layers: int = 1) -> DFlashDrafter:
    config = fresh_config(target.config, num_layers=layers, mask_token_id=target.config.vocab_size - 1,
                          block_size=block_size, num_taps=2)
    return DFlashDrafter(config).initialize(seed).to(target.dtype).eval()


def tiny_decoder(seed: int = 0, block_size: int = 16, **kwargs) -> Decoder:
    target = tiny_target(seed, **kwargs)
    return Decoder(target, tiny_drafter(target, seed, block_size), DrafterInfo("random", trained=False))
