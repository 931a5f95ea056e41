"""What one generation asks for, checked once where it is made: ``DecodeSettings``.

Every entry point (the page, the CLIs, the OpenAI API, the bench) builds a ``DecodeSettings`` and shows the
``EngineError`` it raises as it is: one sentence per bad value, naming the setting (``EngineError.field``, the
API's ``param``). What depends on the loaded models (a drafter to draft with, its block size, the context
length) is checked by ``Decoder.prepare``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from engine.errors import EngineError
from engine.methods import AUTO, Budget, check_budget, method

MAX_NEW_TOKENS = 4096
MAX_TEMPERATURE = 2.0  # OpenAI's bound: above it sampling is close to uniform
MAX_SEED = 2**63 - 1  # torch.manual_seed overflows past 64 bits
TRACE_DETAILS = ("full", "tokens")
WARM_UP_TOKENS = 40


def whole_number(value, name: str, field: str, low: int, high: int | None = None) -> int:
    """``value`` as a whole number in ``low..high``, else the sentence that says so (a bool is no number)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise EngineError(f"{name} must be a whole number {span}, got {value!r}", field=field)
    return value


@dataclass(frozen=True)
class DecodeSettings:
    method: str
    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    block_size: int | None = None  # None: the drafter's own
    tree_budget: Budget = 32  # a node count, or "auto": chosen every step for the batch (``engine.loop.batch``)
    record_top_k: int = 8
    trace_detail: str = "full"  # "tokens": steps keep what they commit, not the tree (timing a lean loop)

    def __post_init__(self):
        method(self.method)
        whole_number(self.max_new_tokens, "max new tokens", "max_new_tokens", 1, MAX_NEW_TOKENS)
        temperature = self.temperature
        if (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or math.isnan(temperature)
                or not 0 <= temperature <= MAX_TEMPERATURE):
            raise EngineError(f"temperature must be a number from 0 to {MAX_TEMPERATURE:g}, got {temperature!r}",
                              field="temperature")
        whole_number(self.seed, "seed", "seed", 0, MAX_SEED)
        if self.block_size is not None:
            whole_number(self.block_size, "block size", "block_size", 1)
        object.__setattr__(self, "tree_budget", check_budget(self.tree_budget))
        whole_number(self.record_top_k, "top-k kept per depth", "record_top_k", 0)
        if self.trace_detail not in TRACE_DETAILS:
            raise EngineError(f"trace detail must be one of {', '.join(TRACE_DETAILS)}, got {self.trace_detail!r}",
                              field="trace_detail")

    @property
    def auto_budget(self) -> bool:
        """Whether the tree's size is chosen every step (``tree_budget`` "auto") rather than fixed."""
        return self.tree_budget == AUTO and method(self.method).drafts

    @property
    def label(self) -> str:
        """``ar``, ``dflash``, ``ddtree@32``, ``ddtree@auto``: the run's label (``engine.methods``)."""
        return method(self.method).label(self.tree_budget)

    @property
    def apart(self) -> tuple[str, str]:
        """What tells runs apart where they take turns (``engine.loop.race``): each keeps buffers of its own."""
        return self.label, self.trace_detail

    def warm_up(self) -> DecodeSettings:
        """The same run cut short, past two steps that each accept a whole block of 16: it builds (compiles,
        captures) every program this run will use, so that a timed run after it pays for none of them."""
        return replace(self, max_new_tokens=min(WARM_UP_TOKENS, self.max_new_tokens))
