"""What the loop asks of a target model and of the fixed step's KV cache, declared once.

Each has more than one implementation, and the loop (``engine.loop``) knows only these:

- ``TargetModel``: ``engine.models.target.Target`` (a Hugging Face model, dense or hybrid) and
  ``engine.on_vllm.vllm_worker.PagedTarget`` (a vLLM worker's model over its paged cache). The vLLM
  driver's ``ClientTarget`` is a ``Target`` for encoding and decoding text only: its runs happen
  in the workers.
- ``FixedKV``: ``engine.models.target.StaticKV`` (transformers' ``StaticCache``) and
  ``engine.on_vllm.vllm_worker.PagedKV`` (vLLM's paged cache), both made by ``TargetModel.fixed_kv``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TargetModel(Protocol):
    """The model being sped up: it encodes the prompt, verifies a tree in one pass, and keeps the
    accepted path's cache."""

    name: str
    stop_ids: list[int]

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def config(self): ...  # the Hugging Face config: widths, layers, vocabulary

    @property
    def context_length(self) -> int: ...

    @property
    def embedding(self) -> torch.Tensor: ...  # the drafter embeds its block with the target's table

    @property
    def lm_head(self) -> torch.Tensor: ...  # ... and reads its logits through the target's head

    @property
    def runs_fixed_step(self) -> bool: ...  # whether ``fixed_kv`` can serve the fixed-shape step

    @property
    def runs_batched(self) -> bool: ...  # whether ``verify_batch`` can verify many requests' trees in one pass

    @property
    def verifies_slots(self) -> bool: ...  # whether ``verify_slots`` runs a batch's fixed-shape step

    def chat_ids(self, prompt: str) -> list[int]: ...

    def conversation_ids(self, messages: list[dict[str, str]]) -> list[int]: ...

    def text_ids(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_text(self, token: int) -> str: ...  # one token alone, special tokens written out (a trace's text)

    def new_cache(self): ...  # the readable step's cache, passed back into ``forward`` and ``commit``

    def tree_bias(self, visible: torch.Tensor, past_length: int) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, attention_bias=None,
                hidden_states: bool = False, last_logits: bool = False) -> tuple[torch.Tensor, tuple | None]: ...

    def commit(self, cache, past_length: int, accepted: list[int]) -> None: ...

    def fixed_kv(self, capacity: int, compiled: bool = False) -> FixedKV: ...

    def verify_batch(self, verify_pass, kv, layout, hidden_states: bool) -> tuple[torch.Tensor, tuple | None]: ...

    def verify_slots(self, kv, rows: torch.Tensor, read, ids: torch.Tensor, positions: torch.Tensor,
                     past: torch.Tensor, visible: torch.Tensor, hidden_states: bool
                     ) -> tuple[torch.Tensor, tuple | None]: ...

    def capturing(self) -> AbstractContextManager: ...  # the batch's CUDA graphs' capture context; yields its stream


@runtime_checkable
class FixedKV(Protocol):
    """The fixed-shape step's KV cache: buffers that never change shape, a write cursor held in a
    device tensor, so that a step's programs replay as CUDA graphs. A decoder keeps one, shared by all its
    programs (each run rewrites it from its prompt on), and asks ``TargetModel.fixed_kv`` for a larger one
    when a run needs more rows (``engine.loop.decode.Decoder.fixed_kv``)."""

    forks_states: bool  # linear-attention states fork per tree node: even AR's one token commits

    def prefill_cache(self): ...  # the cache a run's prefill writes its prompt into (``TargetModel.forward``)

    def capturing(self) -> AbstractContextManager: ...  # a CUDA graph's capture context; yields its stream

    def verify(self, ids: torch.Tensor, positions: torch.Tensor, past: torch.Tensor,
               visible: torch.Tensor) -> tuple[torch.Tensor, tuple]: ...

    def compact(self, past: torch.Tensor, path: torch.Tensor, length: torch.Tensor) -> None: ...
