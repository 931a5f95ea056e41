"""DDTree's fixed-shape tree build (``ddtree.fixed.build_tree``, a beam per depth) as one Triton program per tree.

``ddtree.fixed.build_tree`` runs its per-depth recurrence as a few dozen small kernels (a top-k
per depth, then two sorts and the gathers of the global cut); inside the step's CUDA graph each
costs a launch. Here, after one top-k over the vocabulary, a single program per tree keeps the
beam in registers: per depth it scores (beam entry, token) pairs and keeps the best ``budget``
with one sort of packed keys (the path log-probability's bits above the pair's index, so a sort
of integers orders by probability and breaks ties by index); then the global cut and the
parents-first order are two more sorts, and the parents are looked up through a small table in
memory. Same nodes as ``ddtree.fixed.build_tree`` (ties aside, which either may break its own way).

Only the pairs that can be kept are sorted. Entries and token ranks both come best first, so
the pair (e, t) is beaten by the (e+1)(t+1) - 1 pairs (e' <= e, t' <= t) other than itself, on
score or, at a tie, on its lower index: it can be kept only if (e+1)(t+1) <= budget. Those pairs
lie in log2(budget) + 1 blocks of ``budget`` pairs each (row 0 with every rank; rows
[2^l, 2^(l+1)) with the best budget / 2^l ranks): at budget 64, 512 keys a depth instead of
4096. Sorting every pair made this kernel cost more than the tree attention at an 8B model's shape
(docs/HISTORY.md, "GPU: the vLLM engine"; benchmarks/shapes/gpu-qwen3-8b-random-compiled.json).
Budgets whose blocks exceed ``MAX_PAIRS`` stay on the readable path (``fused_fits``).
"""

from __future__ import annotations

import torch

import ddtree.fixed
from ddtree.fixed import FixedTree
from engine.gpu.triton_support import tl, triton, triton_runs_on

MAX_PAIRS = 1024  # keys one program sorts per depth (budget 128)


if triton is not None:

    @triton.jit
    def _ordered(values):
        """float32 -> int32 whose signed order is the floats' order (-inf lowest)."""
        bits = values.to(tl.int32, bitcast=True)
        return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)

    @triton.jit
    def _unordered(keys):
        return tl.where(keys < 0, keys ^ 0x7FFFFFFF, keys).to(tl.float32, bitcast=True)

    @triton.jit
    def _first_row(values, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
        """The first COLUMNS entries of a 1-D tensor of ROWS * COLUMNS."""
        table = tl.reshape(values, (ROWS, COLUMNS))
        return tl.sum(tl.where(tl.arange(0, ROWS)[:, None] == 0, table, 0), axis=0)

    @triton.jit
    def _store_pair_keys(path_buffer, scores, keys_out, FIRST: tl.constexpr, ROWS: tl.constexpr, BUDGET: tl.constexpr,
                         COLUMNS: tl.constexpr, WIDTH: tl.constexpr, WIDTH_P: tl.constexpr):
        """Keys of the pairs (beam entries FIRST .. FIRST+ROWS-1) x (token ranks 0 .. COLUMNS-1), row by row;
        ranks past WIDTH_P are not pairs (their index would name another pair): the lowest key."""
        entry = FIRST + tl.arange(0, ROWS)[:, None]
        token = tl.arange(0, COLUMNS)[None, :]
        path = tl.load(path_buffer + entry)
        score = tl.load(scores + token, mask=token < WIDTH, other=float("-inf"))
        candidates = tl.where((entry < BUDGET) & (token < WIDTH), path + score, float("-inf"))
        pair = entry * WIDTH_P + token
        keys = (_ordered(candidates).to(tl.int64) << 32) | (0xFFFFFFFF - pair.to(tl.int64))
        keys = tl.where(token < WIDTH_P, keys, -9223372036854775807)
        tl.store(keys_out + tl.arange(0, ROWS)[:, None] * COLUMNS + token, keys)

    @triton.jit
    def _beam_tree_kernel(
        top_lp,  # [rows, DEPTH, WIDTH] float32: each depth's best log-probabilities, best first
        top_tokens,  # [rows, DEPTH, WIDTH] int64: their tokens
        beam_parent,  # [rows, DEPTH, BUDGET_P] int64, scratch: each beam entry's parent entry a depth up
        beam_rank,  # [rows, DEPTH, BUDGET_P] int64, scratch: each beam entry's token rank
        node_of,  # [rows, DEPTH, BUDGET] int64, scratch: each beam entry's node, -1 for none
        path_buffer,  # [rows, BUDGET_P] float32, scratch: the beam's path log-probabilities
        pair_keys,  # [rows, PAIRS_P] int64, scratch: a depth's sort keys
        tokens, parents, depths,  # [rows, BUDGET] int64 each: the tree, parents first
        log_probs, path_log_probs,  # [rows, BUDGET] float32 each
        ranks,  # [rows, BUDGET] int64
        valid,  # [rows, BUDGET] int8
        DEPTH: tl.constexpr, DEPTH_P: tl.constexpr, BUDGET: tl.constexpr, BUDGET_P: tl.constexpr,
        WIDTH: tl.constexpr, WIDTH_P: tl.constexpr, LEVELS: tl.constexpr, PAIRS_P: tl.constexpr,
    ):
        row = tl.program_id(0)
        top_lp += row * DEPTH * WIDTH
        top_tokens += row * DEPTH * WIDTH
        beam_parent += row * DEPTH * BUDGET_P
        beam_rank += row * DEPTH * BUDGET_P
        node_of += row * DEPTH * BUDGET
        path_buffer += row * BUDGET_P
        pair_keys += row * PAIRS_P
        pairs = tl.arange(0, PAIRS_P)
        out = row * BUDGET
        low = 0xFFFFFFFF
        lowest = -9223372036854775807
        entry = tl.arange(0, BUDGET_P)
        kept = entry < BUDGET

        # depth 1: the best tokens under the root
        path = tl.load(top_lp + entry, mask=kept & (entry < WIDTH), other=float("-inf"))
        tl.store(beam_parent + entry, tl.zeros_like(entry))
        tl.store(beam_rank + entry, tl.where(entry < WIDTH, entry, 0))
        global_keys = tl.full((DEPTH_P, BUDGET_P), lowest, tl.int64)
        depth_rows = tl.arange(0, DEPTH_P)[:, None]
        beam_keys = (_ordered(path).to(tl.int64) << 32) | (low - (0 * BUDGET + entry)).to(tl.int64)
        global_keys = tl.where((depth_rows == 0) & kept[None, :], beam_keys[None, :], global_keys)

        for depth in range(1, DEPTH):  # a loop, not unrolled: the program stays small to compile
            tl.store(path_buffer + entry, path)
            tl.debug_barrier()
            _store_pair_keys(path_buffer, top_lp + depth * WIDTH, pair_keys, 0, 1, BUDGET, BUDGET_P, WIDTH, WIDTH_P)
            for level in tl.static_range(LEVELS):
                _store_pair_keys(path_buffer, top_lp + depth * WIDTH, pair_keys + (level + 1) * BUDGET_P, 1 << level,
                                 1 << level, BUDGET, BUDGET_P >> level, WIDTH, WIDTH_P)
            tl.debug_barrier()
            keys = tl.load(pair_keys + pairs, mask=pairs < (LEVELS + 1) * BUDGET_P, other=lowest)
            best = _first_row(tl.sort(keys, descending=True), PAIRS_P // BUDGET_P, BUDGET_P)
            chosen = low - (best & low)
            path = tl.where(kept, _unordered((best >> 32).to(tl.int32)), float("-inf"))
            tl.store(beam_parent + depth * BUDGET_P + entry, chosen // WIDTH_P)
            tl.store(beam_rank + depth * BUDGET_P + entry, chosen % WIDTH_P)
            beam_keys = (_ordered(path).to(tl.int64) << 32) | (low - (depth * BUDGET + entry)).to(tl.int64)
            global_keys = tl.where((depth_rows == depth) & kept[None, :], beam_keys[None, :], global_keys)

        # the global cut: the best BUDGET entries over all depths (a shallower entry first on a tie)
        cut = _first_row(tl.sort(tl.reshape(global_keys, (DEPTH_P * BUDGET_P,)), descending=True), DEPTH_P, BUDGET_P)
        index = low - (cut & low)  # depth * BUDGET + beam entry
        value_key = (cut >> 32).to(tl.int32)
        depth_of = index // BUDGET
        # parents first: by depth, then path log-probability, then entry
        order_keys = ((127 - depth_of) << 56) | ((value_key.to(tl.int64) + 2147483648) << 24) | (16777215 - index)
        order = tl.sort(tl.where(kept, order_keys, lowest), descending=True)
        index = 16777215 - (order & 16777215)
        value = _unordered((((order >> 24) & low) - 2147483648).to(tl.int32))
        depth_of = index // BUDGET
        beam_entry = index % BUDGET

        all_entries = tl.arange(0, DEPTH_P * BUDGET_P)
        tl.store(node_of + all_entries, tl.full((DEPTH_P * BUDGET_P,), -1, tl.int64),
                 mask=all_entries < DEPTH * BUDGET)
        tl.debug_barrier()
        tl.store(node_of + index, entry + 1, mask=kept)
        tl.debug_barrier()
        parent_entry = tl.load(beam_parent + depth_of * BUDGET_P + beam_entry, mask=kept, other=0)
        parent = tl.load(node_of + tl.maximum(depth_of - 1, 0) * BUDGET + parent_entry, mask=kept & (depth_of > 0),
                         other=0)
        rank = tl.load(beam_rank + depth_of * BUDGET_P + beam_entry, mask=kept, other=0)
        tl.store(tokens + out + entry, tl.load(top_tokens + depth_of * WIDTH + rank, mask=kept, other=0), mask=kept)
        tl.store(parents + out + entry, tl.maximum(parent, 0), mask=kept)
        tl.store(depths + out + entry, depth_of + 1, mask=kept)
        tl.store(log_probs + out + entry, tl.load(top_lp + depth_of * WIDTH + rank, mask=kept, other=0.0), mask=kept)
        tl.store(path_log_probs + out + entry, value, mask=kept)
        tl.store(ranks + out + entry, rank, mask=kept)
        tl.store(valid + out + entry, (value > float("-inf")).to(tl.int8), mask=kept)


def pair_blocks(budget: int) -> tuple[int, int]:
    """(levels, keys a depth's sort takes): row 0's block and one block of ``budget`` pairs per level."""
    budget_p = triton.next_power_of_2(budget)
    levels = budget_p.bit_length() - 1
    return levels, triton.next_power_of_2(levels + 1) * budget_p


def fused_fits(device: torch.device, budget: int) -> bool:
    """Whether ``fused_beam_tree`` runs here: Triton on this device (or its interpreter) and at most
    ``MAX_PAIRS`` keys a depth."""
    return triton_runs_on(device) and pair_blocks(budget)[1] <= MAX_PAIRS


def fused_beam_tree(log_probs: torch.Tensor, budget: int) -> FixedTree:  # log_probs [..., depth, vocab]
    """``ddtree.fixed.build_tree`` as one top-k and one Triton launch (where ``fused_fits``)."""
    *batch, depth, vocab = log_probs.shape
    width = min(budget, vocab)
    top_lp, top_tokens = torch.topk(log_probs.float(), width, dim=-1)
    rows = top_lp.reshape(-1, depth, width).shape[0]
    device = log_probs.device
    budget_p = triton.next_power_of_2(budget)
    long = dict(dtype=torch.long, device=device)
    beam_parent = torch.empty(rows, depth, budget_p, **long)
    beam_rank = torch.empty(rows, depth, budget_p, **long)
    node_of = torch.empty(rows, depth, budget, **long)
    levels, pairs_p = pair_blocks(budget)
    path_buffer = torch.empty(rows, budget_p, dtype=torch.float32, device=device)
    pair_keys = torch.empty(rows, pairs_p, **long)
    tokens, parents, depths, ranks = (torch.empty(rows, budget, **long) for _ in range(4))
    node_log_probs, path_log_probs = (torch.empty(rows, budget, dtype=torch.float32, device=device) for _ in range(2))
    valid = torch.empty(rows, budget, dtype=torch.int8, device=device)
    _beam_tree_kernel[(rows,)](top_lp.contiguous(), top_tokens.contiguous(), beam_parent, beam_rank, node_of,
                               path_buffer, pair_keys, tokens, parents, depths, node_log_probs, path_log_probs, ranks,
                               valid, DEPTH=depth, DEPTH_P=triton.next_power_of_2(depth), BUDGET=budget,
                               BUDGET_P=budget_p, WIDTH=width, WIDTH_P=triton.next_power_of_2(width), LEVELS=levels,
                               PAIRS_P=pairs_p)
    shaped = lambda t: t.reshape(*batch, budget)  # noqa: E731
    return FixedTree(tokens=shaped(tokens), parents=shaped(parents), depths=shaped(depths),
                     log_probs=shaped(node_log_probs), path_log_probs=shaped(path_log_probs), ranks=shaped(ranks),
                     valid=shaped(valid).bool())


def fused_tree_program(builder, device: torch.device, nodes: int):
    """The fast program that replaces a fixed-shape tree builder here (``fused_beam_tree`` for
    ``ddtree.fixed.build_tree`` where it ``fused_fits``), or None where the builder runs as written."""
    if builder is ddtree.fixed.build_tree and fused_fits(device, nodes):
        return fused_beam_tree
    return None
