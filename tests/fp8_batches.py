"""Random paged-attention batches in fp8 caches, and the dequantize-then-attend oracle (fp8 tests)."""

from __future__ import annotations

import random

import torch

from pagedkv.kernels import fp8, reference


def fp8_batch(dtype, q_lens, seq_lens, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16, seed=0):
    """Random q, K and V written into scattered fp8 blocks through the reference write; returns the
    paged_attention arguments, the scales and the float32 K/V of every slot."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables = torch.zeros(len(seq_lens), max(-(-n // block_size) for n in seq_lens), dtype=torch.int32)
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=g) * 3
    v = torch.randn(sum(seq_lens), num_kv_heads, head_dim, generator=g)
    slots = []
    for i, n in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(-(-n // block_size))]
        tables[i, :len(blocks)] = torch.tensor(blocks)
        slots += [blocks[t // block_size] * block_size + t % block_size for t in range(n)]
    k_scale, v_scale = fp8.scale_for(k, dtype), fp8.scale_for(v, dtype)
    reference.write_kv_cache(k, v, k_cache, v_cache, torch.tensor(slots), k_scale, v_scale)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, head_dim ** -0.5)
    return args, k_scale, v_scale


def dequantize_then_attend(args, k_scale, v_scale):
    q, k_cache, v_cache, *rest = args
    return reference.paged_attention(q, k_cache.float() * k_scale, v_cache.float() * v_scale, *rest)
