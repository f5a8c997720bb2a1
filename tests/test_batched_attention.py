"""The batched CPU paged attention equals the per-sequence oracle (`kernels.reference.paged_attention`)."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.kernels import reference


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """Scattered block tables whose unused columns hold -1; returns the paged_attention arguments."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((len(seq_lens), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, head_dim ** -0.5


@pytest.mark.parametrize("seed", range(4))
def test_batched_attention_equals_the_oracle_on_random_mixed_batches(seed):
    rng = random.Random(seed)
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 12)):  # decode, prefill, extend and idle (q_len 0) sequences
        q_len = rng.choice([0, 1, 1, 1, rng.randint(2, 40)])
        seq_lens.append(q_len + rng.choice([0, rng.randint(1, 90)]) or 1)
        q_lens.append(min(q_len, seq_lens[-1]))
    args = make_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=16, block_size=8,
                      dtype=torch.float32, seed=seed)
    expected = reference.paged_attention(*args)
    got = reference.batched_paged_attention(*args)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_batched_attention_chunks_long_batches_without_changing_the_result(monkeypatch):
    args = make_batch([1] * 9 + [17, 5], [3, 70, 12, 9, 33, 64, 65, 1, 40, 17, 50], num_heads=4, num_kv_heads=4,
                      head_dim=8, block_size=16, dtype=torch.float32, seed=9)
    whole = reference.batched_paged_attention(*args)
    monkeypatch.setattr(reference, "_GATHER_BUDGET", 1)  # one sequence per chunk
    torch.testing.assert_close(reference.batched_paged_attention(*args), whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(whole, reference.paged_attention(*args), atol=1e-5, rtol=0)


def test_batched_attention_in_bf16_rounds_like_the_oracle():
    args = make_batch([1, 1, 9], [30, 7, 20], num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                      dtype=torch.bfloat16, seed=3)
    out = torch.empty_like(args[0])
    got = reference.batched_paged_attention(*args, out=out)
    assert got is out and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference.paged_attention(*args).float(), atol=2e-2, rtol=0)
