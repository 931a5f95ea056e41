"""Verify passes whose every row attends as AR's one-token step of the same token does, bit for bit.

AR's one-token steps take vLLM 0.23's 3D launch of ``kernel_unified_attention``: the keys split into 16 segments of
16-key tiles, each segment its own online softmax, then ``reduce_segments`` combines them. A pass of more rows takes
its 2D launch (32-key tiles, one online softmax), and a tree's query-query bias (``qq_bias``) has a node meet its
ancestors among masked siblings, in other tiles and lanes: in bf16 both round otherwise than AR's step. Here each
row of a verify pass reads its keys where AR's step of its token reads them (key ``v`` below the committed context
is the cache's row ``v``; key ``context + k`` is the row of its ancestor at depth ``k``, ``ddtree.forks.path_table``,
``k = depth`` itself) and runs that step's launch: the 3D segments, masks and arithmetic op for op, at its tile,
query block and warps, for the settings the Studio runs (no sliding window, sinks, soft cap, ALiBi or quantized KV
cache), and the combine as ``reduce_segments`` does it. A chain is a tree whose paths are prefixes of one another.
A pass verifies one request's tree or many requests' trees packed in vLLM's flat layout (``query_start_loc``: each
request's nodes follow the last's, each request its own row of block ids, its own sequence length and its own
tree, whose paths name nodes by their index inside it); a one-request pass is a batch of one.

vLLM's kernel with the query bias stays the readable reference (``DDTREE_ATTENTION=bias`` in the environment runs
it); the tests hold this to AR's step of every node, and on a GPU to vLLM's own kernels.
"""

from __future__ import annotations

import torch

from engine.gpu.triton_support import tl, triton

TILE_SIZE = 16  # vLLM's 3D launch's tile (``_get_tile_size(is_prefill=False)``, 2-byte caches)
SEGMENTS = 16  # its segments (``NUM_PAR_SOFTMAX_SEGMENTS``)


def block_rows(queries_per_kv: int) -> int:
    """Query rows a program holds: the heads that share one KV head, padded as vLLM pads them."""
    return 16 if queries_per_kv <= 16 else triton.next_power_of_2(queries_per_kv)


if triton is not None:
    @triton.jit
    def _request_of(query_start_ptr, token, num_requests):
        """The request whose nodes hold flat token ``token``: a binary search of ``query_start`` (as vLLM's
        ``find_seq_idx`` does it)."""
        left = 0
        right = num_requests
        while left < right:
            middle = (left + right) // 2
            if tl.load(query_start_ptr + middle) <= token:
                left = middle + 1
            else:
                right = middle
        return left - 1

    @triton.jit
    def _segments(
        segm_out_ptr,  # [nodes, num_query_heads, NUM_SEGMENTS, HEAD_SIZE_PADDED] float32
        segm_max_ptr,  # [nodes, num_query_heads, NUM_SEGMENTS] float32
        segm_sum_ptr,  # [nodes, num_query_heads, NUM_SEGMENTS] float32
        q_ptr,  # [nodes, num_query_heads, HEAD_SIZE]
        k_cache_ptr,  # [blocks, BLOCK_SIZE, kv heads, HEAD_SIZE]
        v_cache_ptr,  # [blocks, BLOCK_SIZE, kv heads, HEAD_SIZE]
        block_table_ptr,  # [requests, max blocks]: each request's block ids
        seq_len_ptr,  # [requests] int32: each request's context + nodes
        query_start_ptr,  # [requests + 1] int32: where each request's nodes begin among the pass's
        table_ptr,  # [nodes, length] int32: each node's ancestor at each depth (its index in its own tree)
        depth_ptr,  # [nodes] int32
        scale, num_requests, block_table_stride,
        q_stride_0, q_stride_1, table_stride, k_stride_0, k_stride_1, k_stride_2, v_stride_0, v_stride_1, v_stride_2,
        k_stride_3: tl.constexpr, v_stride_3: tl.constexpr,
        num_query_heads: tl.constexpr, queries_per_kv: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
        HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, BLOCK_M: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
    ):
        node = tl.program_id(0)
        kv_head = tl.program_id(1)
        segment = tl.program_id(2)
        request = _request_of(query_start_ptr, node, num_requests)
        first_node = tl.load(query_start_ptr + request)
        num_nodes = tl.load(query_start_ptr + request + 1) - first_node
        context = tl.load(seq_len_ptr + request) - num_nodes  # committed keys, before this pass's nodes
        position = context + tl.load(depth_ptr + node)  # the node's key: where AR's step puts its token
        seen = position + 1  # AR's step's sequence length
        tiles_per_segment = tl.cdiv(seen, NUM_SEGMENTS * TILE)
        if segment * tiles_per_segment * TILE >= seen:
            return
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_SIZE_PADDED)
        offs_t = tl.arange(0, TILE)
        head = kv_head * queries_per_kv + offs_m % queries_per_kv
        dim_mask = offs_d < HEAD_SIZE
        row_mask = (offs_m < queries_per_kv) & (head < num_query_heads)
        q = tl.load(q_ptr + node * q_stride_0 + head[:, None] * q_stride_1 + offs_d[None, :],
                    mask=dim_mask[None, :] & row_mask[:, None], other=0.0)
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
        first = segment * tiles_per_segment
        for j in range(first, tl.minimum(first + tiles_per_segment, tl.cdiv(seen, TILE))):
            key = j * TILE + offs_t
            tile_mask = key < seen
            on_path = key >= context
            ancestor = tl.load(table_ptr + node * table_stride + (key - context), mask=on_path & tile_mask, other=0)
            slot = tl.where(on_path, context + ancestor, key)
            block = tl.load(block_table_ptr + request.to(tl.int64) * block_table_stride + slot // BLOCK_SIZE,
                            mask=tile_mask, other=0).to(tl.int64)
            k = tl.load(k_cache_ptr + block[None, :] * k_stride_0 + kv_head * k_stride_2 + offs_d[:, None] * k_stride_3
                        + (slot % BLOCK_SIZE)[None, :] * k_stride_1,
                        mask=dim_mask[:, None] & tile_mask[None, :], other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + block[:, None] * v_stride_0 + kv_head * v_stride_2 + offs_d[None, :] * v_stride_3
                        + (slot % BLOCK_SIZE)[:, None] * v_stride_1,
                        mask=dim_mask[None, :] & tile_mask[:, None], other=0.0).to(q.dtype)
            # vLLM's tile step, op for op (``kernel_unified_attention``, ``softmax_step``)
            s = tl.zeros([BLOCK_M, TILE], dtype=tl.float32)
            s += scale * tl.dot(q, k)
            s = tl.where(row_mask[:, None] & (key[None, :] <= position), s, float("-inf"))
            m_j = tl.maximum(m, tl.max(s, axis=1))
            m_j = tl.where(m_j > float("-inf"), m_j, 0.0)
            p = tl.exp(s - m_j[:, None])
            l_j = tl.sum(p, axis=1)
            alpha = tl.exp(m - m_j)
            l = l * alpha + l_j
            m = m_j
            acc = acc * alpha[:, None]
            acc += tl.dot(p.to(v.dtype), v)
        # the segment's partial softmax, laid out as the 3D launch lays it out for ``reduce_segments``
        rows = node.to(tl.int64) * num_query_heads + head
        tl.store(segm_out_ptr + (rows[:, None] * NUM_SEGMENTS + segment) * HEAD_SIZE_PADDED + offs_d[None, :], acc,
                 mask=dim_mask[None, :] & row_mask[:, None])
        tl.store(segm_max_ptr + rows * NUM_SEGMENTS + segment, m, mask=row_mask)
        tl.store(segm_sum_ptr + rows * NUM_SEGMENTS + segment, l, mask=row_mask)

    @triton.jit
    def _combine(
        out_ptr,  # [nodes, num_query_heads, HEAD_SIZE]
        segm_out_ptr,  # [nodes, num_query_heads, NUM_SEGMENTS, HEAD_SIZE_PADDED] float32 (``_segments``)
        segm_max_ptr,  # [nodes, num_query_heads, NUM_SEGMENTS] float32
        segm_sum_ptr,  # [nodes, num_query_heads, NUM_SEGMENTS] float32
        seq_len_ptr,  # [requests] int32: each request's context + nodes
        query_start_ptr,  # [requests + 1] int32
        depth_ptr,  # [nodes] int32
        num_requests, out_stride_0, out_stride_1,
        num_query_heads: tl.constexpr, TILE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr,
        NUM_SEGMENTS: tl.constexpr,
    ):
        """vLLM's ``reduce_segments``, op for op, for one node's row: its sequence is AR's step's."""
        node = tl.program_id(0)
        query_head = tl.program_id(1)
        request = _request_of(query_start_ptr, node, num_requests)
        num_nodes = tl.load(query_start_ptr + request + 1) - tl.load(query_start_ptr + request)
        seq_len = tl.load(seq_len_ptr + request) - num_nodes + tl.load(depth_ptr + node) + 1
        tiles_per_segment = tl.cdiv(seq_len, NUM_SEGMENTS * TILE)
        act_num_segments = tl.cdiv(seq_len, tiles_per_segment * TILE)
        segm_mask = tl.arange(0, NUM_SEGMENTS) < tl.full([NUM_SEGMENTS], act_num_segments, dtype=tl.int32)
        dim_mask = tl.where(tl.arange(0, HEAD_SIZE_PADDED) < HEAD_SIZE, 1, 0).to(tl.int1)
        segm_offset = (node.to(tl.int64) * (num_query_heads * NUM_SEGMENTS) + query_head * NUM_SEGMENTS
                       + tl.arange(0, NUM_SEGMENTS))
        segm_max = tl.load(segm_max_ptr + segm_offset, mask=segm_mask, other=float("-inf"))
        overall_max = tl.max(segm_max)
        segm_expsum = tl.load(segm_sum_ptr + segm_offset, mask=segm_mask, other=0.0)
        segm_expsum = segm_expsum * tl.exp(segm_max - overall_max)
        overall_expsum = tl.sum(segm_expsum)
        segm_output_offset = (node.to(tl.int64) * (num_query_heads * NUM_SEGMENTS * HEAD_SIZE_PADDED)
                              + query_head * (NUM_SEGMENTS * HEAD_SIZE_PADDED)
                              + tl.arange(0, NUM_SEGMENTS)[:, None] * HEAD_SIZE_PADDED
                              + tl.arange(0, HEAD_SIZE_PADDED)[None, :])
        segm_output = tl.load(segm_out_ptr + segm_output_offset, mask=segm_mask[:, None] & dim_mask[None, :], other=0.0)
        segm_output *= tl.exp(segm_max - overall_max)[:, None]
        acc_sum = tl.sum(segm_output, axis=0)
        acc = tl.where(overall_expsum == 0.0, 0.0, acc_sum / overall_expsum)
        # the cast tl.store makes implicitly, spelled out for Triton's interpreter, which stores bf16 bits otherwise
        tl.store(out_ptr + node * out_stride_0 + query_head * out_stride_1 + tl.arange(0, HEAD_SIZE_PADDED),
                 acc.to(out_ptr.dtype.element_ty), mask=dim_mask)


def path_attention(
    q: torch.Tensor,  # [nodes, query heads, head size]
    k_cache: torch.Tensor,  # [blocks, block size, KV heads, head size]
    v_cache: torch.Tensor,  # [blocks, block size, KV heads, head size]
    out: torch.Tensor,  # [nodes, query heads, head size]
    block_table: torch.Tensor,  # [requests, max blocks]
    seq_lens: torch.Tensor,  # [requests] int32
    query_start: torch.Tensor,  # [requests + 1] int32
    table: torch.Tensor,  # [nodes, length] int32
    depth: torch.Tensor,  # [nodes] int32
    scale: float,
) -> None:
    """A verify pass of one or more requests' trees: ``q`` and ``out`` [nodes, query heads, head size], the requests'
    nodes one request after another (``query_start`` [requests + 1] int32, vLLM's ``query_start_loc``); the caches
    in vLLM's layout [blocks, block size, KV heads, head size], each request's nodes already written after its
    committed context (its node i at its row ``context + i``); ``block_table`` [requests, max blocks], each request's
    row of block ids; ``seq_lens`` [requests] int32, each request's context + nodes (vLLM's ``seqused_k``);
    ``table`` [nodes, length] and ``depth`` [nodes] int32 (``ddtree.forks``, each request's tree's own: a path names
    nodes by their index in their request's tree). Worked example, two requests of 3 and 2 nodes::

        query_start = [0, 3, 5]    seq_lens = [40 + 3, 7 + 2]    depth = [0, 1, 1,  0, 1]
        table = [[0, -], [0, 1], [0, 2],  [0, -], [0, 1]]    (request 1's node 1 is flat token 4)
    """
    nodes, query_heads, head_size = q.shape
    requests = seq_lens.shape[0]
    kv_heads = k_cache.shape[2]
    queries_per_kv = query_heads // kv_heads
    padded = triton.next_power_of_2(head_size)
    segm_out = torch.empty(nodes, query_heads, SEGMENTS, padded, dtype=torch.float32, device=q.device)
    segm_max = torch.empty(nodes, query_heads, SEGMENTS, dtype=torch.float32, device=q.device)
    segm_sum = torch.empty_like(segm_max)
    _segments[(nodes, kv_heads, SEGMENTS)](
        segm_out, segm_max, segm_sum, q, k_cache, v_cache, block_table, seq_lens, query_start, table, depth, scale,
        requests, block_table.stride(0),
        q.stride(0), q.stride(1), table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_stride_3=k_cache.stride(3),
        v_stride_3=v_cache.stride(3), num_query_heads=query_heads, queries_per_kv=queries_per_kv,
        BLOCK_SIZE=k_cache.shape[1], TILE=TILE_SIZE, HEAD_SIZE=head_size, HEAD_SIZE_PADDED=padded,
        BLOCK_M=block_rows(queries_per_kv), NUM_SEGMENTS=SEGMENTS)
    _combine[(nodes, query_heads)](
        out, segm_out, segm_max, segm_sum, seq_lens, query_start, depth, requests, out.stride(0), out.stride(1),
        num_query_heads=query_heads, TILE=TILE_SIZE, HEAD_SIZE=head_size, HEAD_SIZE_PADDED=padded,
        NUM_SEGMENTS=SEGMENTS)
