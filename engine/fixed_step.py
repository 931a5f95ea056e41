"""DFlash and DDTree steps as fixed-shape programs: the device holds the loop's state and the
host reads one small tensor per step (the committed tokens and their count).

A step is two programs over buffers that never change shape:

- ``draft``: the drafter's pass over ``StaticDraftContext``, fed the previous step's accepted
  rows (padded to the block) and their count;
- ``advance``: the tree (``ddtree.fixed``: beam tree or chain, ancestor closure), one verify
  pass of the target over a KV cache in fixed buffers whose write cursor is a device tensor
  (``StaticKV``), the pointer-jumping walk, the KV compaction of the accepted path and the
  drafter's next context, all in place.

Nothing in them depends on a host value, so on CUDA each is captured once and replayed as a
CUDA graph (``graphs=True``); on the CPU they run as written. ``FixedRun`` is ``engine.decode``'s
loop with this step (greedy only: a sampled walk needs per-node draws, which stay in the readable
loop), and tests hold its output to AR's, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import ddtree
from ddtree.fixed import FixedTree, accepted_path, ancestor_closure, beam_tree, chain
from engine.decode import _Outcome, _Run
from engine.drafter import StaticDraftContext
from engine.drafting import _log_probs


class StaticKV:
    """A Hugging Face target's KV cache in fixed buffers (transformers' ``StaticCache``): a verify
    writes its block at rows ``past .. past + n`` (the cache's write cursor, set from a device
    tensor), the mask shows every row before ``past`` and the tree's ancestors in the block, and
    a compaction moves the accepted rows down to ``past``; the cache's last row is scratch."""

    def __init__(self, target, capacity: int):
        from transformers import StaticCache

        self.target, self.capacity = target, capacity
        self.cache = StaticCache(config=target.config, max_cache_len=capacity)
        self.rows = torch.arange(capacity, device=target.device)

    def verify(self, ids: torch.Tensor, positions: torch.Tensor, past: torch.Tensor, visible: torch.Tensor):
        n = ids.shape[0]
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(past)
        shown = (self.rows < past)[None, :].expand(n, -1).clone()
        block = (self.rows[None, :] - past).clamp(0, n - 1)
        in_block = (self.rows >= past) & (self.rows < past + n)
        shown |= in_block[None, :] & visible.gather(1, block.expand(n, -1))
        dtype = self.target.dtype
        bias = torch.zeros(n, self.capacity, dtype=dtype, device=ids.device).masked_fill_(~shown, torch.finfo(dtype).min)
        return self.target.forward(ids[None], positions[None], self.cache, bias[None, None], hidden_states=True)

    def compact(self, past: torch.Tensor, path: torch.Tensor, length: torch.Tensor) -> None:
        slots = torch.arange(path.numel(), device=path.device)
        sources = past + path
        targets = torch.where(slots < length, past + slots, self.capacity - 1)
        for layer in self.cache.layers:
            for cache in (layer.keys, layer.values):
                cache.index_copy_(2, targets, cache.index_select(2, sources))
            layer.cumulative_length.copy_(past + length)


@dataclass
class StepOutput:
    """One step's results, on the device; the host reads ``length`` and ``committed`` to go on,
    the rest when it records the step."""

    log_probs: torch.Tensor  # [D, vocab] the draft's per-depth distributions
    tree: FixedTree
    target_tokens: torch.Tensor  # [n + 1] the target's choice after each node, root first
    path: torch.Tensor  # [D + 1] accepted node indices, root first, padded with the leaf
    length: torch.Tensor  # [] accepted nodes, root included = tokens committed
    committed: torch.Tensor  # [D + 1] accepted draft tokens, then the bonus
    margins: torch.Tensor  # [D + 1] the target's top-1 minus top-2 logit along the path


class FixedProgram:
    """The buffers and the two programs of one (method, budget, block size) for one decoder."""

    def __init__(self, decoder, method: str, budget: int, block_size: int, capacity: int, graphs: bool = False):
        target, drafter = decoder.target, decoder.drafter
        device, dtype = target.device, target.dtype
        self.target, self.drafter, self.method, self.budget = target, drafter, method, budget
        self.depth = block_size - 1
        self.capacity, self.graphs = capacity, graphs
        width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
        self.context = StaticDraftContext(drafter.config, capacity + block_size, device, dtype)
        self.kv = StaticKV(target, capacity)
        long = dict(dtype=torch.long, device=device)
        self.root = torch.zeros(1, **long)
        self.past = torch.zeros((), **long)
        self.block = torch.full((1, block_size), drafter.mask_token_id, **long)
        self.block_offsets = torch.arange(block_size, **long)
        self.block_positions = torch.zeros(1, block_size, **long)
        self.features = torch.zeros(1, block_size, width, dtype=dtype, device=device)
        self.feature_positions = torch.zeros(1, block_size, **long)
        self.feature_count = torch.zeros((), **long)
        self.log_probs = torch.zeros(self.depth, drafter.config.vocab_size, device=device)  # the draft, for advance
        self._graphs: dict[str, tuple[torch.cuda.CUDAGraph, object]] = {}

    def reset(self) -> None:
        """Before a run's prefill: empty caches (the stale rows are overwritten or masked)."""
        self.context.length.zero_()
        for layer in self.kv.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.zero_()

    def start(self, root: int, past: int) -> None:
        """After the prefill: the first committed token and its position."""
        self.root.fill_(root)
        self.past.fill_(past)

    # -- the draft

    def first_draft(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """After the prefill the new context is the whole prompt, longer than a block: eagerly."""
        self._place_block()
        return self.log_probs.copy_(_log_probs(self.drafter, self.target.embedding, self.target.lm_head, self.block,
                                               self.block_positions, features, positions, self.context,
                                               features.shape[1]))

    def draft(self) -> torch.Tensor:
        return self._run("draft", self._draft)

    def _draft(self) -> torch.Tensor:
        self._place_block()
        return self.log_probs.copy_(_log_probs(self.drafter, self.target.embedding, self.target.lm_head, self.block,
                                               self.block_positions, self.features, self.feature_positions,
                                               self.context, self.feature_count))

    def _place_block(self) -> None:
        self.block[0, :1].copy_(self.root)
        torch.add(self.block_offsets, self.past, out=self.block_positions[0])

    # -- tree, verify, walk, commit

    def advance(self) -> StepOutput:
        """The step after its draft (in ``self.log_probs``)."""
        return self._run("advance", self._advance)

    def _advance(self) -> StepOutput:
        log_probs = self.log_probs
        tree = chain(log_probs) if self.method == "dflash" else beam_tree(log_probs, self.budget)
        ids = torch.cat([self.root, tree.tokens])
        positions = self.past + torch.cat([torch.zeros_like(self.root), tree.depths])
        visible = ancestor_closure(tree.parents, self.depth)
        logits, hidden = self.kv.verify(ids, positions, self.past, visible)
        target_tokens = logits.argmax(dim=-1)
        path, length, bonus = accepted_path(tree, target_tokens, self.depth)
        self.kv.compact(self.past, path, length)
        features = self.drafter.context_features(hidden)[0]
        self.features[0].copy_(features.index_select(0, path))
        torch.add(self.block_offsets, self.past, out=self.feature_positions[0])
        self.feature_count.copy_(length)
        slots = torch.arange(self.depth + 1, device=ids.device)
        along = ids.index_select(0, torch.cat([path[1:], path[-1:]]))
        committed = torch.where(slots < length - 1, along, bonus)
        top2 = logits.index_select(0, path).float().topk(2, dim=-1).values
        self.past.add_(length)
        self.root.copy_(bonus[None])
        return StepOutput(log_probs, tree, target_tokens, path, length, committed, top2[:, 0] - top2[:, 1])

    def _run(self, name: str, program):
        """``program()`` eagerly, or (``graphs``) replayed from the CUDA graph captured at its first call."""
        if not self.graphs:
            return program()
        if name not in self._graphs:
            out = program()  # this call's result is the eager run; the capture below only records
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = program()
            self._graphs[name] = (graph, captured)
            return out
        graph, captured = self._graphs[name]
        graph.replay()
        return captured


def as_draft_tree(tree: FixedTree) -> ddtree.DraftTree:
    """The fixed tree's real nodes as the readable ``DraftTree`` (what a trace records)."""
    keep = tree.valid
    return ddtree.DraftTree(tree.tokens[keep].cpu(), tree.parents[keep].cpu(), tree.depths[keep].cpu(),
                            tree.log_probs[keep].cpu(), tree.path_log_probs[keep].cpu(), tree.ranks[keep].cpu())


class FixedRun(_Run):
    """``engine.decode``'s loop with the fixed-shape step. The draft and the rest of the step
    are two device programs; the host reads the committed tokens once per step, and the tree,
    path and target choices only to record the trace. Stage times: ``draft``, ``verify`` (the
    tree, the verify pass, the walk and the compaction: one program) and ``commit`` (the read)."""

    def __init__(self, decoder, settings, config, on_step, should_stop, program: FixedProgram):
        super().__init__(decoder, settings, config, on_step, should_stop)
        self.program = program
        self.cache = program.kv.cache  # the prefill writes the prompt into the fixed buffers
        self.draft_pass = None

    def prefill(self):
        self.program.reset()
        prefill = super().prefill()
        self.program.start(self.root, self.start)
        return prefill

    def step(self, index: int):
        t_start = self.clock.now() - self.t0
        root = self.root
        with self.clock.stage("draft"):
            log_probs = (self.program.first_draft(self.new_context, self.new_context_positions) if index == 0
                         else self.program.draft())
        with self.clock.stage("verify"):
            out = self.program.advance()
        with self.clock.stage("commit"):
            length = int(out.length)  # the one read the loop needs
            accepted = out.path[:length].tolist()
            tokens = out.committed[:length].tolist()
            tree = as_draft_tree(out.tree)
            committed = self.clip(tokens)
            self.output_ids.extend(committed)
            outcome = _Outcome(tree, out.target_tokens[: tree.size + 1].tolist(), accepted, tokens[-1], committed,
                               pieces=[self.text.push(token) for token in committed],
                               margins=out.margins[: len(committed)].tolist())
            self.start += length
            self.root = tokens[-1]
        return self.record(index, t_start, root, log_probs, outcome)
