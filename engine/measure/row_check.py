"""Whether a verify pass scores each row as AR's one-token step does, bit for bit, on any ``Target``.

A verify pass over a chain of AR's own greedy tokens holds, in every row, an AR step: row i after
the context must give AR's i-th logits bit for bit. A tree holds the chain and siblings beside it;
its chain rows must too. ``check`` verifies one context as a chain and as a tree of each row count,
counts the rows whose logits equal AR's, and for the first row that does not names the first module
(in execution order) whose output differs from that row's AR step's. The command is
``engine.tools.row_invariance``; vLLM's workers run ``check`` on their own target (``engine.on_vllm.vllm_worker``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

import ddtree
from engine.models.target import Target


@dataclass(frozen=True)
class RowCheck:
    """One verify pass against AR's steps: its shape, rows, and where its numbers leave AR's."""

    prompt_id: str
    shape: str  # "chain" or "tree"
    rows: int
    equal_rows: int  # rows on AR's path whose logits equal AR's bit for bit
    compared_rows: int
    max_abs_diff: float  # over the compared rows' logits
    first_row: int | None  # the first row on AR's path whose logits leave AR's (0: the root)
    first_module: str | None  # that row's first module whose output differs from its AR step's
    module_abs_diff: float


class ModuleTap:
    """Every leaf module's first output in a pass, for one row (``row``; by name, in execution order).
    ``batched``: the modules' outputs lead with a batch of one, [1, q, ...] (Hugging Face), not with the
    pass's tokens, [q, ...] (vLLM, where a per-head output is [q, heads, head size])."""

    def __init__(self, model: torch.nn.Module, batched: bool = True):
        self.outputs: dict[str, torch.Tensor] = {}
        self.row, self.batched = 0, batched
        self.handles = [module.register_forward_hook(self._hook(name)) for name, module in model.named_modules()
                        if name and not list(module.children())]

    def _hook(self, name: str):
        def keep(module, inputs, output):
            tensor = output[0] if isinstance(output, tuple) else output
            if name not in self.outputs and torch.is_tensor(tensor) and tensor.dim() >= 2:
                rows = tensor[0] if self.batched and tensor.dim() >= 3 else tensor
                if self.row < rows.shape[0]:
                    self.outputs[name] = rows[self.row].detach().clone()
        return keep

    def take(self) -> dict[str, torch.Tensor]:
        outputs, self.outputs = self.outputs, {}
        return outputs

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def first_difference(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[str | None, float]:
    """The first module (in the reference's execution order) whose output is not the reference's, bit for bit."""
    for name, expected in reference.items():
        got = ours.get(name)
        if got is not None and got.shape == expected.shape and not torch.equal(got, expected):
            return name, float((got.double() - expected.double()).abs().max())
    return None, 0.0


@dataclass(frozen=True)
class ArSteps:
    """AR from the context: its greedy tokens (the prefill's first) and each step's logits."""

    tokens: list[int]  # tokens[0]: the prefill's next token, the root of every verify pass
    logits: list[torch.Tensor]  # logits[i]: the step that takes tokens[i]


def ar_steps(target: Target, cache, past: int, first: int, steps: int) -> ArSteps:
    tokens, logits = [first], []
    for step in range(steps):
        out = _ar_step(target, cache, past, step, tokens[-1])
        logits.append(out[0])
        tokens.append(int(out[0].argmax()))
    return ArSteps(tokens[:steps], logits)


def _ar_step(target: Target, cache, past: int, step: int, token: int) -> torch.Tensor:
    ids = torch.tensor([[token]], device=target.device)
    return target.forward(ids, torch.tensor([[past + step]], device=target.device), cache)[0]


def ar_modules(target: Target, cache, past: int, ar: ArSteps, step: int, tap: ModuleTap) -> dict[str, torch.Tensor]:
    """The module outputs of AR's step ``step`` (decoding again from the context in ``cache``, which it advances)."""
    for i in range(step + 1):
        tap.take()
        _ar_step(target, cache, past, i, ar.tokens[i])
    return tap.take()


def tree_with_siblings(chain: int, rows: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    """Parents (``ddtree`` convention: node i's parent, 0 the root) of a tree of ``rows`` nodes holding a chain of
    ``chain`` (its rows have AR counterparts) and siblings hanging off random chain nodes, one after each chain node
    while they last: the chain's ancestors sit apart in the pass, as the nodes of a DDTree path do. Returns the
    parents and the chain's node indices."""
    generator = torch.Generator().manual_seed(seed)
    parents, on_path, siblings = [], [0], rows - chain

    def sibling() -> None:
        parents.append(on_path[int(torch.randint(0, len(on_path), (1,), generator=generator))])

    for _ in range(chain - 1):
        if siblings:
            sibling()
            siblings -= 1
        parents.append(on_path[-1])
        on_path.append(len(parents))
    for _ in range(siblings):
        sibling()
    return torch.tensor(parents, dtype=torch.long), on_path


def check(target: Target, prompt_id: str, context: list[int], rows_list: list[int], seed: int = 0
          ) -> list[RowCheck]:
    tap = ModuleTap(target.model, target.batched_modules)
    try:
        cache = target.new_cache()
        ids = torch.tensor([context], device=target.device)
        prefill, _ = target.forward(ids, torch.arange(len(context), device=target.device)[None], cache,
                                    last_logits=True)
        past = len(context)
        ar = ar_steps(target, copy.deepcopy(cache), past, int(prefill[-1].argmax()), max(rows_list))
        checks = []
        for rows in rows_list:
            chain = max(1, rows // 2)
            shapes = {"chain": (torch.arange(rows - 1), list(range(rows)))}
            if rows > 1:
                shapes["tree"] = tree_with_siblings(chain, rows, seed + rows)
            for shape, (parents, on_path) in shapes.items():
                checks.append(_verify(target, tap, cache, past, ar, prompt_id, shape, parents, on_path, seed + rows))
        return checks
    finally:
        tap.close()


def _verify(target: Target, tap: ModuleTap, cache, past: int, ar: ArSteps, prompt_id: str, shape: str,
            parents: torch.Tensor, on_path: list[int], seed: int) -> RowCheck:
    """One verify pass from the context in ``cache`` (left as it is); where a row leaves AR, the pass again
    and AR's step for that row, module by module."""
    rows = parents.numel() + 1
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (rows,), generator=generator)
    tokens[on_path] = torch.tensor(ar.tokens[:len(on_path)])
    visible = ddtree.ancestor_mask(parents)
    depth = visible.sum(dim=1) - 1
    bias = target.tree_bias(visible, past) if rows > 1 else None

    def verify() -> torch.Tensor:
        return target.forward(tokens[None].to(target.device), (past + depth)[None].to(target.device),
                              copy.deepcopy(cache), bias)[0]

    logits = verify()
    # the path's node at depth d holds AR's token d: its row is AR's step d (a chain's node d is row d; a tree's is not)
    diffs = [float((logits[node].double() - ar.logits[depth].double()).abs().max())
             for depth, node in enumerate(on_path)]
    first_row = next((index for index, diff in enumerate(diffs) if diff != 0), None)
    first_module, module_diff = None, 0.0
    if first_row is not None:
        tap.take()
        tap.row = on_path[first_row]
        verify()
        ours = tap.take()
        tap.row = 0
        first_module, module_diff = first_difference(ours, ar_modules(target, copy.deepcopy(cache), past, ar, first_row,
                                                                      tap))
    return RowCheck(prompt_id, shape, rows, sum(diff == 0 for diff in diffs), len(diffs), max(diffs), first_row,
                    first_module, module_diff)
