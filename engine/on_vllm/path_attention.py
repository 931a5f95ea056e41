"""Tree verification whose every row attends as AR's one-token step of the same token does, bit for bit.

vLLM verifies a tree with a query-query bias (``qq_bias``): a node sees its ancestors where they sit in the pass,
among masked siblings. Its online softmax then meets the same keys in other tiles, and in other lanes of a tile,
than AR's step of the same token does, and in bf16 the sums round otherwise (``engine.tools.row_invariance``: in
vLLM's worker a chain's rows equal AR's steps bit for bit at 1 to 129 rows, a tree's do not). Here each node reads
its keys at AR's positions: key ``v`` below the committed context is the cache's row ``v``; key ``context + k`` is
the row of the node's ancestor at depth ``k`` (``ddtree.forks.path_table``; ``k = depth``: the node itself). The tile
loop, masks and arithmetic are those of vLLM 0.23's 2D launch of ``kernel_unified_attention`` (at its prefill tile,
its block of query rows and its default warps) for the settings the Studio runs it with: no sliding window, sinks,
soft cap, ALiBi or quantized KV cache. So a node's row is what that kernel gives AR's step of its token.

The query bias stays the readable reference (``DDTREE_ATTENTION=bias`` in the environment runs it); the tests hold
this kernel to AR's step of every node, and on a GPU to vLLM's own kernel.
"""

from __future__ import annotations

import torch

from engine.gpu.triton_support import tl, triton

TILE_SIZE = 32  # vLLM's 2D launch, every pass of more than one token (``_get_tile_size(is_prefill=True)``)


def block_rows(queries_per_kv: int) -> int:
    """Query rows a program holds: the heads that share one KV head, padded as vLLM pads them."""
    return 16 if queries_per_kv <= 16 else triton.next_power_of_2(queries_per_kv)


if triton is not None:
    @triton.jit
    def _path_attention(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_len_ptr, table_ptr,
                        depth_ptr, scale, num_nodes, q_stride_0, q_stride_1, out_stride_0, out_stride_1,
                        table_stride, k_stride_0, k_stride_1, k_stride_2, v_stride_0, v_stride_1, v_stride_2,
                        k_stride_3: tl.constexpr, v_stride_3: tl.constexpr, num_query_heads: tl.constexpr,
                        queries_per_kv: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                        HEAD_SIZE: tl.constexpr, HEAD_SIZE_PADDED: tl.constexpr, BLOCK_M: tl.constexpr):
        node = tl.program_id(0)
        kv_head = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_SIZE_PADDED)
        offs_t = tl.arange(0, TILE)
        head = kv_head * queries_per_kv + offs_m % queries_per_kv
        dim_mask = offs_d < HEAD_SIZE
        row_mask = (offs_m < queries_per_kv) & (head < num_query_heads)
        q = tl.load(q_ptr + node * q_stride_0 + head[:, None] * q_stride_1 + offs_d[None, :],
                    mask=dim_mask[None, :] & row_mask[:, None], other=0.0)

        context = tl.load(seq_len_ptr) - num_nodes  # committed keys, before this pass's nodes
        position = context + tl.load(depth_ptr + node)  # the node's key: where AR's step puts its token
        seen = position + 1
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
        for j in range(0, tl.cdiv(seen, TILE)):
            key = j * TILE + offs_t
            tile_mask = key < seen
            on_path = key >= context
            ancestor = tl.load(table_ptr + node * table_stride + (key - context), mask=on_path & tile_mask, other=0)
            slot = tl.where(on_path, context + ancestor, key)
            block = tl.load(block_table_ptr + slot // BLOCK_SIZE, mask=tile_mask, other=0).to(tl.int64)
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
        acc = acc / l[:, None]
        # the cast tl.store makes implicitly, spelled out for Triton's interpreter, which stores bf16 bits otherwise
        tl.store(out_ptr + node * out_stride_0 + head[:, None] * out_stride_1 + offs_d[None, :],
                 acc.to(out_ptr.dtype.element_ty),
                 mask=dim_mask[None, :] & row_mask[:, None])


def path_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                   block_table: torch.Tensor, seq_len: torch.Tensor, table: torch.Tensor, depth: torch.Tensor,
                   scale: float) -> None:
    """One request's tree pass: ``q`` and ``out`` [nodes, query heads, head size]; the caches in vLLM's layout
    [blocks, block size, KV heads, head size], this pass's nodes already written after the committed context (node i
    at row ``context + i``); ``block_table`` the request's row of block ids; ``seq_len`` [1] int32, context + nodes
    (vLLM's ``seqused_k``); ``table`` [nodes, length] and ``depth`` [nodes] int32 (``ddtree.forks``)."""
    nodes, query_heads, head_size = q.shape
    kv_heads = k_cache.shape[2]
    queries_per_kv = query_heads // kv_heads
    _path_attention[(nodes, kv_heads)](
        out, q, k_cache, v_cache, block_table, seq_len, table, depth, scale, nodes, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_stride_3=k_cache.stride(3),
        v_stride_3=v_cache.stride(3), num_query_heads=query_heads, queries_per_kv=queries_per_kv,
        BLOCK_SIZE=k_cache.shape[1], TILE=TILE_SIZE, HEAD_SIZE=head_size,
        HEAD_SIZE_PADDED=triton.next_power_of_2(head_size), BLOCK_M=block_rows(queries_per_kv))
