"""A draft tree in a paged KV cache (vLLM's layout): attention metadata and compaction moves.

The tree block is written to consecutive cache rows ``past .. past + n`` (row = node index),
while RoPE positions are ``past + depth``. Attention runs causally over rows, so a node
sees the whole past and every earlier node; the query-query bias then hides the nodes
that are not its ancestors. After the walk, the accepted path is moved down to rows
``past .. past + len(path)`` so the cache reads like plain AR decoding again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.batch import BatchLayout
from ddtree.fixed import compaction_rows
from ddtree.forks import depths, path_table


def query_bias(visible: torch.Tensor) -> torch.Tensor:
    """Additive ``[q, q]`` float32 bias among a verify block's queries: 0 where ``visible``
    (the tree's ancestors-and-self mask), -inf elsewhere."""
    bias = torch.full(visible.shape, float("-inf"), dtype=torch.float32, device=visible.device)
    return bias.masked_fill_(visible, 0.0)


def compaction_moves(past_length: int, accepted: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to copy so the accepted path (node indices, root first) sits right after the past.

    Returns ``(source_rows, target_rows)``, leaving out rows already in place (the root,
    and the prefix of the path that stayed on the tree's first nodes). Copy all sources
    before writing any target: a later source may be an earlier target.
    """
    path = torch.tensor(accepted, dtype=torch.long)
    target = torch.arange(len(accepted), dtype=torch.long)
    moved = path != target
    return past_length + path[moved], past_length + target[moved]


def compaction_moves_of(rows: list[int], pasts: list[int], paths: list[list[int]]
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``compaction_moves`` of many requests (request ``rows[i]``, ``pasts[i]`` rows before its root, accepted
    ``paths[i]``) as one list: ``(row, source_column, target_column)`` ``[moves]`` each. E.g. rows [3, 5], pasts
    [10, 7], paths [[0, 2], [0, 1]]: one move, row 3's column 12 to 11 (row 5's path stayed in place)."""
    moves = [compaction_moves(past, path) for past, path in zip(pasts, paths)]
    if not moves:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    row = torch.cat([torch.full_like(source, row) for row, (source, _) in zip(rows, moves)])
    return row, torch.cat([source for source, _ in moves]), torch.cat([target for _, target in moves])


def compaction_slots(block_table: torch.Tensor, past: torch.Tensor, path: torch.Tensor, length: torch.Tensor,
                     block_size: int, scratch_slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Many requests' compactions as one list of moves between cache slots (vLLM's: block id * block_size +
    offset), each request's rows through its own row of ``block_table [R, max blocks]``. Request r's accepted
    node k (``path [R, P]``, root first, ``length [R]`` of them) moves from its row ``past[r] + path[r, k]``
    to ``past[r] + k``; a padding move reads the request's root and writes ``scratch_slot``, which no request
    reads. Requests own their blocks, so two requests' moves never meet. Returns ``(sources, targets)``,
    ``[R * P]`` each; copy all sources before writing any target (``move_rows``, ``RowMover``).

    Worked example (block_size 4): a request owning blocks [7, 2] with past 3 accepted its root and node 2.
    The root stays in row 3 (block 7, offset 3: slot 31 onto itself); node 2, row 5 (block 2, offset 1: slot 9),
    moves to row 4 (slot 8)."""
    kept = torch.arange(path.shape[-1], device=path.device) < length[:, None]  # [R, P]
    # the rows each request's moves read and write (a padding move: its root onto row 0, which the slot replaces)
    sources, targets = compaction_rows(past, torch.where(kept, path, 0), length, scratch=0)
    requests = torch.arange(path.shape[0], device=path.device)[:, None].expand_as(path)
    return (table_slots(block_table, requests, sources, block_size).flatten(),
            torch.where(kept, table_slots(block_table, requests, targets, block_size), scratch_slot).flatten())


def table_slots(block_table: torch.Tensor, requests: torch.Tensor, rows: torch.Tensor, block_size: int
                ) -> torch.Tensor:
    """vLLM's cache slots (block id * block_size + offset) of ``rows`` of ``requests`` (the same shape: each a
    request's row of ``block_table [R, max blocks]``)."""
    return block_table[requests, rows // block_size].long() * block_size + rows % block_size


def verify_slots(layout: BatchLayout, block_table: torch.Tensor, block_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed verify pass (``pack_trees``) on a paged cache, request r through row r of ``block_table``: the
    slot each token's keys and values are written to (``[T]``, vLLM's ``slot_mapping``) and each request's
    sequence length once they are (``[R]``, its ``seq_lens``: its past, its root and its tree).

    Worked example (block_size 4): a request owning blocks [7, 2] with past 3 verifies its root and two nodes.
    They take rows 3, 4, 5: slots 31 (block 7, offset 3), 8 and 9 (block 2, offsets 0 and 1); its sequence
    length is 6."""
    sizes = layout.query_start_loc.diff()  # [R]
    requests = torch.repeat_interleave(torch.arange(layout.requests, device=sizes.device), sizes)  # [T]
    return (table_slots(block_table, requests, layout.kv_columns, block_size),
            layout.kv_columns[layout.query_start_loc[1:] - 1] + 1)


def verify_paths(layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed verify pass's trees as path attention reads them (``engine.on_vllm.path_attention``): each token's
    ancestor at every depth, named by its index in its own request's tree (``ddtree.forks.path_table``; columns past
    a token's depth repeat it), ``[T, longest tree]`` int32, and each token's depth, ``[T]`` int32. Every request's
    tree at once (``verify_paths_readable`` walks them one by one).

    Worked example: a request whose root has a child 1, and 1 a child 2; then a request of its root alone::

        table = [[0, 0, 0], [0, 1, 1], [0, 1, 2],  [0, 0, 0]]    depth = [0, 1, 2,  0]
    """
    sizes = layout.query_start_loc.diff()  # [R]
    longest = layout.padded.shape[1]  # every request's tree padded to the longest (``pack_trees``)
    requests, width = layout.requests, layout.width
    nodes = torch.arange(longest)
    # [R, longest, longest]: each request's own tree's ancestors-and-self mask, out of its columns of the cache
    columns = layout.kv_columns[layout.query_start_loc[:-1]][:, None] + nodes  # [R, longest]
    inside = nodes[None, :] < sizes[:, None]  # [R, longest]
    trees = layout.visible.gather(2, columns.clamp(max=width - 1)[:, None, :].expand(requests, longest, longest))
    trees &= inside[:, None, :]
    depth = trees.sum(dim=2) - 1  # [R, longest]
    at = torch.where(trees, depth[:, None, :], longest)  # an ancestor's depth, or a spare column
    table = nodes[None, :, None].expand(requests, longest, longest + 1).contiguous()
    table.scatter_(2, at, nodes[None, None, :].expand(requests, longest, longest))
    table = table[:, :, :longest].reshape(requests * longest, longest)
    return table[layout.unpadded].to(torch.int32), depth.reshape(-1)[layout.unpadded].to(torch.int32)


def verify_paths_readable(layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_paths`` one request at a time: the reference it is tested against."""
    sizes = layout.query_start_loc.diff().tolist()  # [R]
    longest = max(sizes)
    tables, depth = [], []
    for r, size in enumerate(sizes):
        start = int(layout.kv_columns[layout.query_start_loc[r]])
        visible = layout.visible[r, :size, start:start + size]  # [size, size]: ancestors and self
        table = path_table(visible, size)
        tables.append(torch.cat([table, table[:, -1:].expand(size, longest - size)], dim=1))
        depth.append(depths(visible))
    return torch.cat(tables).to(torch.int32), torch.cat(depth).to(torch.int32)


@dataclass(frozen=True)
class PaddedVerify:
    """A packed verify pass (``pack_trees``) padded to fixed shapes, so one recorded pass (a CUDA graph) serves every
    batch that fits: ``tokens`` rows and ``requests`` request slots. The real requests come first; a padding
    request then holds the padding tokens, each its own root at depth 0 in column 0 of that request's cache row
    (the scratch block, in a block table whose padding rows name it); the request slots after it hold no tokens."""

    input_ids: torch.Tensor  # [tokens] long: the pass's tokens, then zeros
    position_ids: torch.Tensor  # [tokens] long
    query_start: torch.Tensor  # [requests + 1] int32: vLLM's ``query_start_loc``, the padding request's end repeated
    seq_lens: torch.Tensor  # [requests] int32: each request's past and nodes (the padding request: its tokens)
    paths: torch.Tensor  # [tokens, width] int32: ``verify_paths``' table, its first ``width`` columns
    depth: torch.Tensor  # [tokens] int32
    requests: torch.Tensor  # [tokens] long: each token's request slot
    columns: torch.Tensor  # [tokens] long: each token's cache column in its request's row


def padded_verify(layout: BatchLayout, tokens: int, requests: int, width: int) -> PaddedVerify:
    """``layout`` (on the host) padded to ``tokens`` rows and ``requests`` request slots, its paths to ``width``
    columns (path attention reads a node's columns up to its depth). The padding request is slot ``R``, so
    ``requests`` must exceed the layout's R. Worked example: requests of 2 and 1 tokens padded to 5 tokens and
    4 slots::

        query_start = [0, 2, 3, 5, 5]    seq_lens = [past0 + 2, past1 + 1, 2, 0]    requests = [0, 0, 1, 2, 2]
    """
    count, real = layout.tokens, layout.requests
    if count > tokens or real >= requests:
        raise ValueError(f"a pass of {count} tokens for {real} requests does not fit {tokens} rows and "
                         f"{requests - 1} requests")
    paths, depth = (verify_paths(layout) if real else
                    (torch.zeros(0, width, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)))
    if real and int(depth.max()) >= width:
        raise ValueError(f"a path {int(depth.max()) + 1} deep does not fit {width} columns")
    sizes = layout.query_start_loc.diff()  # [R]

    def padded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [count, ...] -> [tokens, ...]
        out = torch.zeros(tokens, *values.shape[1:], dtype=dtype)
        out[:count] = values
        return out

    query_start = torch.full((requests + 1,), tokens, dtype=torch.int32)
    query_start[:real + 1] = layout.query_start_loc
    seq_lens = torch.zeros(requests, dtype=torch.int32)
    seq_lens[:real] = layout.kv_columns[layout.query_start_loc[1:] - 1] + 1
    seq_lens[real] = tokens - count
    owner = torch.full((tokens,), real, dtype=torch.long)
    owner[:count] = torch.repeat_interleave(torch.arange(real), sizes)
    paths = torch.nn.functional.pad(paths[:, :width], (0, width - min(width, paths.shape[1])))  # [count, width]
    return PaddedVerify(padded(layout.input_ids, torch.long), padded(layout.position_ids, torch.long), query_start,
                        seq_lens, padded(paths, torch.int32), padded(depth, torch.int32), owner,
                        padded(layout.kv_columns, torch.long))


def slots_verify(ids: torch.Tensor, positions: torch.Tensor, past: torch.Tensor, visible: torch.Tensor, tokens: int,
                 requests: int, width: int) -> PaddedVerify:
    """``padded_verify`` of a fixed-shape pass of slots (``engine.loop.fixed_batch``), on the device with no host
    read: slot s's ``ids [b, n]`` at ``positions [b, n]`` after its ``past [b]`` columns, ``visible [b, n, n]`` its
    tree's ancestors-and-self mask; the same padded pass as ``padded_verify(pack_trees(...))`` of those trees, every
    slot's ``n`` tokens (a slot's nodes past its budget too: the walk ignores them). ``tokens`` must hold ``b * n``
    and ``requests`` exceed ``b``."""
    count, size = ids.shape
    device = ids.device
    real = count * size
    nodes = torch.arange(size, device=device)
    depth = visible.sum(dim=2) - 1  # [b, n]
    at = torch.where(visible, depth[:, None, :], size)  # an ancestor's depth, or a spare column
    table = nodes[None, :, None].expand(count, size, size + 1).contiguous()
    table.scatter_(2, at, nodes[None, None, :].expand(count, size, size))
    paths = torch.nn.functional.pad(table[:, :, :min(size, width)].reshape(real, -1), (0, max(0, width - size)))
    slots = torch.arange(requests + 1, device=device)
    query_start = torch.where(slots <= count, slots * size, tokens).to(torch.int32)
    seq_lens = torch.where(slots[:-1] < count, torch.cat([past, past.new_zeros(requests - count)]) + size,
                           torch.where(slots[:-1] == count, tokens - real, 0)).to(torch.int32)
    owner = torch.cat([torch.repeat_interleave(torch.arange(count, device=device), size),
                       torch.full((tokens - real,), count, dtype=torch.long, device=device)])

    def padded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [b * n, ...] -> [tokens, ...]
        values = values.to(dtype)
        return torch.cat([values, values.new_zeros(tokens - real, *values.shape[1:])])

    return PaddedVerify(padded(ids.reshape(-1), torch.long), padded(positions.reshape(-1), torch.long), query_start,
                        seq_lens, padded(paths, torch.int32), padded(depth.reshape(-1), torch.int32), owner,
                        padded((past[:, None] + nodes).reshape(-1), torch.long))


def paged_slots(rows: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(block, offset)`` of each cache row when the block table is the identity (row r lives
    in block r // block_size); computed once for all layers of a compaction."""
    return rows // block_size, rows % block_size


def move_rows(cache: torch.Tensor, sources: tuple[torch.Tensor, torch.Tensor],
              targets: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Copy rows (``paged_slots``) of a paged cache laid out ``[blocks, 2 (K, V), block_size, ...]``.
    Gathers before it writes."""
    cache[targets[0], :, targets[1]] = cache[sources[0], :, sources[1]]
