"""The CPU attention backends equal the per-sequence oracle (`kernels.reference.paged_attention`).

Both `reference.batched_paged_attention` (the ``torch`` backend) and `cpu_kernels.paged_attention`
(the default ``cpu`` backend: rows of up to 2,048 new tokens in the fused C kernel, longer prefill
chunks batched) are held to it.
"""

from __future__ import annotations

import os
import platform
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.kernels import cpu_kernels, reference

BACKENDS = {"torch": reference.batched_paged_attention, "cpu": cpu_kernels.paged_attention}


@pytest.fixture(autouse=True, scope="module")
def _fused_kernel_builds():
    """On CI the C kernel must build: a missing compiler would silently test the fallback twice."""
    assert cpu_kernels.fused_available(), "cpu_attention.c did not build (is a C compiler installed?)"


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_batched_attention_equals_the_oracle_on_random_mixed_batches(seed, backend):
    rng = random.Random(seed)
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 12)):  # decode, prefill, extend and idle (q_len 0) sequences
        q_len = rng.choice([0, 1, 1, 1, rng.randint(2, 40)])
        seq_lens.append(q_len + rng.choice([0, rng.randint(1, 90)]) or 1)
        q_lens.append(min(q_len, seq_lens[-1]))
    args = make_batch(q_lens, seq_lens, num_heads=6, num_kv_heads=2, head_dim=16, block_size=8,
                      dtype=torch.float32, seed=seed)
    expected = reference.paged_attention(*args)
    got = BACKENDS[backend](*args)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_batched_attention_chunks_long_batches_without_changing_the_result(monkeypatch):
    args = make_batch([1] * 9 + [17, 5], [3, 70, 12, 9, 33, 64, 65, 1, 40, 17, 50], num_heads=4, num_kv_heads=4,
                      head_dim=8, block_size=16, dtype=torch.float32, seed=9)
    whole = reference.batched_paged_attention(*args)
    monkeypatch.setattr(reference, "_GATHER_BUDGET", 1)  # one sequence per chunk
    torch.testing.assert_close(reference.batched_paged_attention(*args), whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(whole, reference.paged_attention(*args), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_attention_in_bf16_rounds_like_the_oracle(backend):
    args = make_batch([1, 1, 9], [30, 7, 20], num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
                      dtype=torch.bfloat16, seed=3)
    out = torch.empty_like(args[0])
    got = BACKENDS[backend](*args, out=out)
    assert got is out and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference.paged_attention(*args).float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, block_size", [
    (8, 8, 4, 16),  # stories260K: a head size the kernel specializes
    (64, 4, 1, 16),  # specialized, one KV head for all (MQA)
    (128, 8, 8, 1),  # specialized, no grouping, one token per block
    (24, 6, 3, 5),  # the generic loop: no specialization, odd block size
])
def test_fused_kernel_equals_the_oracle_for_every_head_layout(head_dim, num_heads, num_kv_heads, block_size):
    q_lens = [1, block_size, 2, 3 * block_size, 7, 1]  # decode, a whole-block prefill, extends
    seq_lens = [1, block_size, block_size + 1, 3 * block_size, 77, 200]  # block edges, one token, long
    args = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=head_dim)
    torch.testing.assert_close(cpu_kernels.paged_attention(*args, max_query_len=3 * block_size, max_seq_len=200),
                               reference.paged_attention(*args), atol=1e-5, rtol=0)


def test_fused_kernel_computes_rows_up_to_its_query_length_and_leaves_longer_ones_to_the_batched_path(monkeypatch):
    args = make_batch([1, 5, 1, 0, 3], [40, 12, 9, 3, 30], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
                      dtype=torch.float32, seed=5)
    calls = []
    batched = reference.batched_paged_attention

    def spy(*a, **kw):
        calls.append(kw.get("fused_max_query_len", 0))
        return batched(*a, **kw)

    monkeypatch.setattr(reference, "batched_paged_attention", spy)
    expected = reference.paged_attention(*args)
    torch.testing.assert_close(cpu_kernels.paged_attention(*args), expected, atol=1e-5, rtol=0)
    assert calls == []  # every row is at most FUSED_MAX_QUERY_LEN (2048): all in C
    monkeypatch.setattr(cpu_kernels, "FUSED_MAX_QUERY_LEN", 4)
    torch.testing.assert_close(cpu_kernels.paged_attention(*args), expected, atol=1e-5, rtol=0)
    assert calls == [4]  # one batched call, for the 5-token row only
    small = make_batch([1, 3], [40, 9], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
                       dtype=torch.float32, seed=6)
    cpu_kernels.paged_attention(*small, max_query_len=3)
    assert calls == [4]  # a step whose rows all fit never enters the batched path


def test_without_a_c_compiler_the_cpu_backend_falls_back_to_the_batched_attention(monkeypatch, tmp_path):
    with monkeypatch.context() as m:
        m.setenv("CC", str(tmp_path / "no-such-compiler"))
        m.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))  # nothing built there yet
        cpu_kernels._library.cache_clear()
        assert not cpu_kernels.fused_available()
        args = make_batch([1, 1, 6], [30, 7, 20], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
                          dtype=torch.float32, seed=7)
        torch.testing.assert_close(cpu_kernels.paged_attention(*args), reference.paged_attention(*args),
                                   atol=1e-5, rtol=0)
        assert list((tmp_path / "cache").iterdir()) == []  # no half-written library left behind
    cpu_kernels._library.cache_clear()
    assert cpu_kernels.fused_available()  # the real compiler builds (or finds) it again


def test_float16_pools_take_the_batched_path():
    assert not cpu_kernels.fused_available(torch.float16)
    args = make_batch([1, 1, 4], [30, 7, 20], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4,
                      dtype=torch.float16, seed=8)
    torch.testing.assert_close(cpu_kernels.paged_attention(*args).float(), reference.paged_attention(*args).float(),
                               atol=2e-3, rtol=0)


def test_fused_kernel_splits_sequences_over_threads_without_changing_the_result():
    # 3 threads get ~4K context tokens each; a prefill row and an idle row sit inside the ranges
    seq_lens = [3000, 700, 2500, 40, 4100, 1, 1800, 900, 2222]
    q_lens = [1, 1, 7, 1, 1, 0, 1, 1, 1]
    args = make_batch(q_lens, seq_lens, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                      dtype=torch.float32, seed=11)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = cpu_kernels.paged_attention(*args)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, reference.paged_attention(*args), atol=1e-5, rtol=0)


# the C kernel's tile path: TILE_Q = 16 new tokens per tile, CHUNK = 32 keys per online-softmax step
TILED_Q_LENS = [1, 2, 16, 17, 33, 50, 5]  # decode, the smallest tile, one full tile, 9 + 8, 11 + 11 + 11, 4 tiles
TILED_CONTEXTS = [40, 0, 31, 5, 32, 100, 0]  # tokens before the new ones (chunked prefill): tiles cross chunk edges


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, block_size", [
    (8, 8, 4, 16),  # stories260K (its decode row takes the eight-heads-per-vector path)
    (64, 8, 2, 16),  # specialized, GQA groups of 4
    (128, 4, 4, 7),  # specialized, no grouping, blocks that do not divide a chunk
    (40, 6, 3, 16),  # generic, a multiple of 8
    (24, 6, 3, 5),  # generic, not a multiple of 8: the plain loops
])
def test_fused_kernel_tiles_prefill_and_extend_rows_like_the_oracle(pool, head_dim, num_heads, num_kv_heads,
                                                                     block_size):
    seq_lens = [q + c for q, c in zip(TILED_Q_LENS, TILED_CONTEXTS)]
    q, k_cache, v_cache, *rest = make_batch(TILED_Q_LENS, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                                            torch.float32, seed=head_dim)
    k_cache, v_cache = k_cache.to(pool), v_cache.to(pool)  # float32 queries over the pool's element type
    scales = {"k_scale": 0.5, "v_scale": 3.0} if pool.itemsize == 1 else {}
    expected = reference.paged_attention(q, k_cache, v_cache, *rest, **scales)
    out = torch.full_like(q, float("nan"))  # a row the kernel skipped would stay NaN
    got = cpu_kernels.paged_attention(q, k_cache, v_cache, *rest, out=out, **scales)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [
    (8, 4, 16),  # stories260K: one pass of eight heads, two per KV head
    (16, 2, 16),  # two passes, eight heads per KV head
    (24, 24, 3),  # three passes, no grouping, blocks of 3
    (4, 2, 16),  # fewer than eight heads: the tile path
])
def test_fused_decode_at_head_dim_8_equals_the_oracle(pool, num_heads, num_kv_heads, block_size):
    # decode rows only: one key, a whole block, a block and one, long, and across the prefetched next block
    seq_lens = [1, block_size, block_size + 1, 200, 2 * block_size + 3]
    q, k_cache, v_cache, *rest = make_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, 8, block_size,
                                            torch.float32, seed=num_heads)
    k_cache, v_cache = k_cache.to(pool), v_cache.to(pool)
    scales = {"k_scale": 0.5, "v_scale": 3.0} if pool.itemsize == 1 else {}
    expected = reference.paged_attention(q, k_cache, v_cache, *rest, **scales)
    got = cpu_kernels.paged_attention(q, k_cache, v_cache, *rest, out=torch.full_like(q, float("nan")), **scales)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads, block_size", [
    (8, 4, 16),  # stories260K: GQA groups of 2
    (8, 8, 5),  # no grouping; blocks that do not divide a chunk of keys
    (16, 2, 16),  # two passes of eight heads, groups of 8
    (16, 8, 7),  # two passes, groups of 2, blocks of 7
])
def test_fused_prefill_and_extend_at_head_dim_8_equal_the_oracle(pool, num_heads, num_kv_heads, block_size):
    # every q_len from 1 to 40 (one to three tiles, crossing chunks of keys), after contexts of 0 to 36
    # tokens, most not a multiple of block_size (extend): the eight-heads-per-vector tile path
    q_lens = list(range(1, 41))
    seq_lens = [q + (7 * q) % 37 for q in q_lens]
    q, k_cache, v_cache, *rest = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, 8, block_size,
                                            torch.float32, seed=num_heads + block_size)
    k_cache, v_cache = k_cache.to(pool), v_cache.to(pool)
    expected = reference.paged_attention(q, k_cache, v_cache, *rest)
    got = cpu_kernels.paged_attention(q, k_cache, v_cache, *rest, out=torch.full_like(q, float("nan")))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_fused_kernel_gives_the_same_bits_on_any_number_of_threads():
    # one 600-token prompt holds most of the work: its tiles spread over the threads
    q_lens, seq_lens = [1, 600, 1, 37, 0, 1], [70, 650, 3, 37, 5, 200]
    args = make_batch(q_lens, seq_lens, num_heads=8, num_kv_heads=4, head_dim=8, block_size=16,
                      dtype=torch.float32, seed=14)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3, 7):
            torch.set_num_threads(n)
            results.append(cpu_kernels.paged_attention(*args, out=torch.full_like(args[0], float("nan"))))
    finally:
        torch.set_num_threads(threads)
    for got in results[1:]:
        assert torch.equal(got, results[0])  # each tile is computed whole by one thread, in the same order
    torch.testing.assert_close(results[0], reference.paged_attention(*args), atol=1e-5, rtol=0)


def test_fused_kernel_refuses_a_block_table_pointing_outside_the_pool_in_a_prompt_split_over_threads():
    q, k_cache, v_cache, tables, seq_lens, qsl, scale = make_batch(
        [1, 400], [20, 410], num_heads=4, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32, seed=15)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for bad in (-1, k_cache.shape[0]):
                broken = tables.clone()
                broken[1, 25] = bad  # the prompt's last block (tokens 400..409)
                with pytest.raises(IndexError, match="outside the pool"):
                    cpu_kernels.paged_attention(q, k_cache, v_cache, broken, seq_lens, qsl, scale)
    finally:
        torch.set_num_threads(threads)


def test_fused_kernel_refuses_a_block_table_pointing_outside_the_pool():
    q, k_cache, v_cache, tables, seq_lens, qsl, scale = make_batch(
        [1, 1], [20, 9], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32, seed=12)
    for bad in (-1, k_cache.shape[0]):  # unused padding (-1) or one past the end, inside the length
        broken = tables.clone()
        broken[1, 2] = bad  # sequence 1 holds 9 tokens: blocks 0..2
        with pytest.raises(IndexError, match="outside the pool"):
            cpu_kernels.paged_attention(q, k_cache, v_cache, broken, seq_lens, qsl, scale)
    broken = tables.clone()
    broken[1, 3] = -7  # past the sequence's length: never read, no error
    torch.testing.assert_close(cpu_kernels.paged_attention(q, k_cache, v_cache, broken, seq_lens, qsl, scale),
                               reference.paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale),
                               atol=1e-5, rtol=0)


def test_a_long_prompt_does_not_pad_the_short_ones_of_its_step():
    # the first 2,048-token chunk of the conv replay (24 prompts, the longest 491): one chunk padded
    # every prompt to 491 x 491 (13.6x the useful score elements); now each chunk pads at most 2x
    lens = sorted([45, 48, 106, 11, 11, 46, 158, 47, 29, 25, 47, 47, 158, 267, 47, 50, 14, 44, 25, 163, 24, 22, 47, 491])
    chunks = reference._chunks(lens, lens, kv_width=4 * 8, num_heads=8)
    assert chunks == [(0, 8, 29), (8, 18, 50), (18, 22, 163), (22, 24, 491)]
    for first, last, max_q in chunks:
        padded = (last - first) * 8 * max_q * lens[last - 1]
        assert padded <= max(2 * sum(8 * n * n for n in lens[first:last]), reference._SMALL_CHUNK)
    args = make_batch(lens, lens, num_heads=8, num_kv_heads=4, head_dim=8, block_size=16, dtype=torch.float32, seed=13)
    torch.testing.assert_close(reference.batched_paged_attention(*args), reference.paged_attention(*args),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(8, 8, 4), (64, 4, 2)])
def test_fused_kernel_on_scores_wider_than_float32s_range_equals_the_oracle(head_dim, num_heads, num_kv_heads):
    # queries 30x larger: scores over a hundred apart, as a trained model's are, so many weights and
    # their products fall below float32's normal range (e^-87), which the kernel flushes to zero
    q_lens, seq_lens = [1, 1, 37, 5], [300, 17, 37, 90]
    q, *rest = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16, torch.float32, seed=head_dim)
    q = q * 30
    expected = reference.paged_attention(q, *rest)
    got = cpu_kernels.paged_attention(q, *rest, out=torch.full_like(q, float("nan")))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_kernel_leaves_the_callers_subnormals_as_they_are(threads):
    """The kernel flushes subnormals only while it runs: PyTorch's float32 in the calling thread keeps them."""
    args = make_batch([1, 40], [120, 40], num_heads=8, num_kv_heads=4, head_dim=8, block_size=16,
                      dtype=torch.float32, seed=16)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_kernels.paged_attention(*args)
    finally:
        torch.set_num_threads(previous)
    assert (torch.tensor([1e-40]) * 0.5).item() == pytest.approx(5e-41, rel=1e-3)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 compiler flag")
def test_kernels_built_for_a_cpu_without_avx512_equal_the_oracle(tmp_path):
    # Built for this CPU, the kernels use 512-bit vectors where it has them (cpu_vector.h's WIDE 16):
    # attend_tile8 two keys a vector, silu_and_mul sixteen lanes. A CPU with AVX2 only runs the eight-lane
    # code; this rebuilds the libraries without AVX-512 (a compiler wrapper) and runs their tests in a
    # fresh process.
    marker = tmp_path / "built"
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\ntouch "{marker}"\nexec "${{REAL_CC:-cc}}" "$@" -mno-avx512f\n')
    cc.chmod(0o755)
    tests = Path(__file__).parent
    env = {**os.environ, "CC": str(cc), "REAL_CC": os.environ.get("CC", "cc"), "PAGEDKV_CACHE_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests / "test_batched_attention.py"),
         str(tests / "test_cpu_ops.py"), "-k", "(head_dim_8 or same_bits or silu_and_mul_equals or wider) and not avx512"],
        env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert marker.exists() and " passed" in run.stdout


def test_a_sequence_with_nan_keys_does_not_reach_the_next_sequence_of_the_kernel():
    # Sequences share one thread's scratch: a chunk with an odd number of keys leaves lanes past its
    # last key, which must not hold the previous sequence's K/V (0 x NaN is NaN).
    q_lens, seq_lens = [32, 5, 1, 3], [32, 5, 9, 7]
    q, k_cache, v_cache, tables, lens, qsl, scale = make_batch(q_lens, seq_lens, 8, 4, 8, 16, torch.float32, seed=17)
    bad = tables[0, :2].long()
    k_cache[bad], v_cache[bad] = float("nan"), float("nan")  # the first sequence's blocks only
    expected = reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale)
    got = cpu_kernels.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale)
    assert got[:32].isnan().all() and expected[:32].isnan().all()
    assert not got[32:].isnan().any()
    torch.testing.assert_close(got[32:], expected[32:], atol=1e-5, rtol=0)


# (heads, KV heads) at head_dim 8: groups 1, 2, 4, 8 take the copies with the group fixed (with
# AVX-512 groups 2, 4 and 8 take scores_by_dim), 3 the copy with it a runtime value
DECODE_GROUPS = [(8, 8), (8, 4), (16, 4), (8, 2), (16, 2), (8, 1), (24, 8)]


def _decode_outputs_head_dim_8(dtype):
    """The C kernel's decode outputs at head_dim 8 for each of DECODE_GROUPS, wide scores (q x 3)."""
    outs = []
    for seed, (num_heads, num_kv_heads) in enumerate(DECODE_GROUPS):
        seq_lens = [1, 16, 17, 40, 97, 5]
        q, k_cache, v_cache, tables, lens, qsl, scale = make_batch([1] * len(seq_lens), seq_lens, num_heads,
                                                                   num_kv_heads, 8, 16, dtype, seed=seed)
        outs.append(cpu_kernels.paged_attention(q * 3, k_cache, v_cache, tables, lens, qsl, scale))
    return outs


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="-mno-avx512f is an x86 compiler flag")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_at_head_dim_8_gives_the_same_bits_with_and_without_avx512(tmp_path, dtype):
    # With AVX-512, attend_heads8 takes a K row's scores by dimension (scores_by_dim) instead of
    # sum_each's shuffles; it keeps sum_each's order of sums, so both builds give the same bits.
    if not cpu_kernels.fused_available(dtype):
        pytest.skip("no C compiler")
    torch.save(_decode_outputs_head_dim_8(dtype), tmp_path / "native.pt")
    marker, cc = tmp_path / "built", tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\ntouch "{marker}"\nexec "${{REAL_CC:-cc}}" "$@" -mno-avx512f\n')
    cc.chmod(0o755)
    env = {**os.environ, "CC": str(cc), "REAL_CC": os.environ.get("CC", "cc"), "PAGEDKV_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    code = (f"import torch, test_batched_attention as t\n"
            f"native = torch.load({str(tmp_path / 'native.pt')!r})\n"
            f"built = t._decode_outputs_head_dim_8(torch.{str(dtype).split('.')[1]})\n"
            f"print([torch.equal(a, b) for a, b in zip(native, built)])\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert marker.exists() and run.stdout.strip() == str([True] * len(DECODE_GROUPS))
