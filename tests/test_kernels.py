"""The Triton kernels agree with the PyTorch reference (`kernels.reference`), run interpreted on CPU.

TRITON_INTERPRET=1 must be in place when triton and the kernel modules are imported
(``@triton.jit`` reads it then) and while they first run (triton imports more modules lazily),
so this module sets it around its import and around its tests, and restores the previous
environment in between.

Tolerances (max abs difference against the fp32 reference on the same rounded inputs, outputs of
magnitude ~1): fp32 2e-5 (summation order only); fp16 2e-3 and bf16 2e-2, i.e. about two units in
the last place of the output dtype (the interpreter rounds bf16 by truncation; on a GPU the
probabilities are also rounded to the cache dtype before P @ V, as in FlashAttention-2).
Cache writes and block copies are exact.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

from fp8_batches import dequantize_then_attend, fp8_batch

from pagedkv.kernels import reference

_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")


def _restore_interpret_env():
    if _SAVED_INTERPRET is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
    # triton.language's own @jit helpers (tl.zeros, ...) were built for compilation; the
    # interpreter cannot call them. Nothing in-process can undo that import.
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set; run this module in its "
                "own process or export TRITON_INTERPRET=1", pytrace=False)
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton_kernels = pytest.importorskip("pagedkv.kernels.triton_kernels")
finally:
    _restore_interpret_env()  # collection must not leak it into other modules' worker processes


@pytest.fixture(scope="module", autouse=True)
def _interpret_while_these_tests_run():
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    _restore_interpret_env()


ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random q and caches with scattered block tables; returns the paged_attention arguments.

    Physical blocks are a random permutation of the pool (with spare blocks), and block-table
    columns beyond a sequence's blocks hold -1, which the kernels must never dereference.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 7
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc, head_dim ** -0.5)


def assert_attention_matches(args, dtype, out=None):
    expected = reference.paged_attention(*args)
    got = triton_kernels.paged_attention(*args, out=out)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=ATOL[dtype], rtol=0)
    return got


# --- paged_attention -------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_matches_reference_at_block_boundaries(block_size):
    """q_len 1 at contexts 1, bs-1, bs, bs+1 and a long random one (split across partitions)."""
    rng = random.Random(block_size)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, rng.randint(300, 1000)]
    args = make_batch([1] * len(seq_lens), seq_lens, num_heads=4, num_kv_heads=2, head_dim=64,
                      block_size=block_size, dtype=torch.float32, seed=block_size)
    assert_attention_matches(args, torch.float32)


def test_long_decode_split_into_many_partitions_matches_reference():
    """One sequence, one KV head: the split-K path uses many partitions and the reduce kernel."""
    args = make_batch([1], [1000], num_heads=1, num_kv_heads=1, head_dim=64, block_size=16,
                      dtype=torch.float32, seed=1)
    assert_attention_matches(args, torch.float32)


MIXED_CASES = [
    # (dtype, num_heads, num_kv_heads, head_dim, block_size): GQA ratios 1, 2, 4, 8
    (torch.float32, 2, 2, 8, 16),
    (torch.float16, 4, 2, 64, 8),
    (torch.bfloat16, 8, 2, 128, 32),
    (torch.float16, 8, 1, 8, 64),
    (torch.bfloat16, 4, 4, 64, 16),
    (torch.float32, 8, 1, 128, 16),
    (torch.float16, 6, 2, 64, 16),  # a group of 3: padded head rows are masked
]


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", MIXED_CASES)
def test_mixed_decode_prefill_extend_batch_matches_reference(dtype, num_heads, num_kv_heads,
                                                             head_dim, block_size):
    """One call: decodes, a fresh prefill, extends of a cached prefix, over block boundaries."""
    rng = random.Random(head_dim * 1000 + block_size)
    bs = block_size
    q_lens = [1, 37, 1, 5, 1, 2 * bs + 3, 9]
    ctx_before = [rng.randint(1, 1000), 0, bs - 1, bs, 0, bs + 1, rng.randint(100, 300)]
    seq_lens = [c + q for c, q in zip(ctx_before, q_lens)]
    args = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                      seed=rng.randint(0, 10**6))
    assert_attention_matches(args, dtype)


@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches_match_reference(seed):
    """Random shapes, dtypes, GQA ratios and a random mix of decodes, prefills and extends."""
    rng = random.Random(seed)
    dtype = rng.choice(list(ATOL))
    num_kv_heads = rng.choice([1, 2])
    num_heads = num_kv_heads * rng.choice([1, 2, 4, 8])
    head_dim = rng.choice([8, 64, 128])
    block_size = rng.choice([8, 16, 32, 64])
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 5)):
        q_len = rng.choice([1, 1, rng.randint(2, 40)])
        q_lens.append(q_len)
        seq_lens.append(q_len + rng.choice([0, rng.randint(1, 1000 - q_len)]))
    args = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                      seed=seed)
    assert_attention_matches(args, dtype)


def test_head_dim_256_block_128_matches_reference():
    args = make_batch([1, 20, 3], [300, 20, 131], num_heads=4, num_kv_heads=2, head_dim=256,
                      block_size=128, dtype=torch.bfloat16, seed=3)
    assert_attention_matches(args, torch.bfloat16)


@pytest.mark.parametrize("dtype,num_heads,num_kv_heads,head_dim,block_size", [
    (torch.float16, 8, 1, 80, 1),  # head_dim 80: padded to 128, the padding masked; GQA 8
    (torch.bfloat16, 8, 2, 96, 8),  # head_dim 96 (Phi-3): GQA 4
    (torch.float32, 5, 1, 96, 128),  # a group of 5 on one KV head: padded head rows masked
])
def test_head_dims_that_are_not_powers_of_two_match_reference(dtype, num_heads, num_kv_heads, head_dim,
                                                              block_size):
    """Decodes (one long enough for split-K and its reduce), a prefill and extends starting mid-block."""
    q_lens = [1, 21, 6, 1, 2]
    ctx_before = [600, 0, block_size + block_size // 2, 3, 2 * block_size - 1]
    args = make_batch(q_lens, [c + q for c, q in zip(ctx_before, q_lens)], num_heads, num_kv_heads,
                      head_dim, block_size, dtype, seed=head_dim + block_size)
    assert_attention_matches(args, dtype)


def test_prefill_longer_than_one_query_tile_matches_reference():
    """A 300-token prompt spans several query tiles; each sees exactly its causal prefix."""
    args = make_batch([300, 1], [300, 40], num_heads=2, num_kv_heads=1, head_dim=64,
                      block_size=16, dtype=torch.float16, seed=4)
    assert_attention_matches(args, torch.float16)


def test_strided_q_and_out_buffer_are_honoured():
    """q as a view of a fused QKV projection; the result lands in the given fp32 `out`."""
    q, k_cache, v_cache, block_tables, seq_lens, qsl, scale = make_batch(
        [1, 6], [17, 40], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        dtype=torch.float16, seed=5)
    qkv = torch.randn(q.shape[0], 8, 64).to(torch.float16)
    qkv[:, :4] = q
    q_view = qkv[:, :4]
    out = torch.full(q.shape, float("nan"))
    args = (q_view, k_cache, v_cache, block_tables, seq_lens, qsl, scale)
    got = triton_kernels.paged_attention(*args, out=out)
    assert got is out
    expected = reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale)
    torch.testing.assert_close(out, expected.float(), atol=ATOL[torch.float16], rtol=0)


def test_sequence_with_no_new_tokens_writes_nothing():
    q, k_cache, v_cache, block_tables, seq_lens, _, scale = make_batch(
        [1, 3], [20, 30], num_heads=2, num_kv_heads=2, head_dim=8, block_size=8,
        dtype=torch.float32, seed=6)
    # Three sequences, the middle one scheduled zero tokens this step.
    block_tables = torch.cat([block_tables[:1], block_tables[:1], block_tables[1:]])
    seq_lens = torch.tensor([20, 20, 30], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 1, 4], dtype=torch.int32)
    assert_attention_matches((q, k_cache, v_cache, block_tables, seq_lens, qsl, scale),
                             torch.float32)


def test_inconsistent_attention_inputs_raise_value_error():
    q, k_cache, v_cache, block_tables, seq_lens, qsl, scale = make_batch(
        [1], [5], num_heads=3, num_kv_heads=3, head_dim=8, block_size=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        triton_kernels.paged_attention(q[:, :2], k_cache[:, :, :], v_cache, block_tables,
                                       seq_lens, qsl, scale)
    with pytest.raises(ValueError, match="int32"):
        triton_kernels.paged_attention(q, k_cache, v_cache, block_tables.float(), seq_lens, qsl,
                                       scale)
    with pytest.raises(ValueError, match="query_start_loc"):
        triton_kernels.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl[:1], scale)


def test_split_k_follows_context_length_as_well_as_batch_size():
    split = sys.modules["pagedkv.kernels.triton_attention"]._decode_split
    tile = 64
    # A big batch fills the GPU alone, yet a 32K context is still cut so no program walks > 32 tiles.
    partition, parts = split(256, 8, 32768, tile, num_sms=132)
    assert partition == 32 * tile and parts == 16
    # A short context is never split, however few programs there are.
    assert split(1, 1, 200, tile, num_sms=132) == (256, 1)
    # One long sequence: split for occupancy, each partition at least 4 tiles.
    partition, parts = split(1, 8, 4096, tile, num_sms=132)
    assert partition == 4 * tile and parts == 16
    # Occupancy wins when the batch is small and the context moderate.
    assert split(4, 8, 8192, tile, num_sms=132) == (8 * tile, 16)


def test_the_warm_up_compiles_the_split_k_reduce_at_every_partition_count_split_k_can_choose(monkeypatch):
    """The reduce kernel is specialized on PARTS_PAD (the partition count's power of two), which follows
    the batch and its context: the warm-up must launch every value `_decode_split` can give, on any GPU
    size, or the first batch needing another one compiles it mid-serving (about a second)."""
    mod = sys.modules["pagedkv.kernels.triton_attention"]
    chosen = set()
    for sms in (1, 16, 108, 132, 170):
        for num_seqs in (1, 2, 3, 7, 16, 64, 256):
            for kv_heads in (1, 2, 4, 8):
                for context in (1, 64, 255, 256, 1000, 4096, 8192, 32768, 131072):
                    for tile in (32, 64):
                        partition, parts = mod._decode_split(num_seqs, kv_heads, context, tile, sms)
                        assert parts <= mod._MAX_PARTITIONS and partition * parts >= context
                        if parts > 1:
                            chosen.add(mod.triton.next_power_of_2(parts))
    launches = []
    real = mod._decode_reduce_kernel
    monkeypatch.setattr(mod, "_decode_reduce_kernel", type("Spy", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (launches.append(kw["PARTS_PAD"]), real[grid](*a, **kw)))})())
    launched = triton_kernels.warm_up_split_k_reduce(4, 24, torch.float32, torch.device("cpu"))
    assert launched == launches == [2, 4, 8, 16, 32, 64]
    assert chosen == set(launched)  # every value split-K chooses is warmed, and only those


def test_decode_only_hint_skips_the_prefill_launch_and_keeps_the_result(monkeypatch):
    args = make_batch([1, 1, 1], [30, 300, 5], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                      dtype=torch.float32, seed=12)
    expected = reference.paged_attention(*args)
    mod = sys.modules["pagedkv.kernels.triton_attention"]
    launches = []
    real = mod._prefill_kernel
    monkeypatch.setattr(mod, "_prefill_kernel", type("Spy", (), {"__getitem__": lambda self, grid: (
        launches.append(grid), real[grid])[1]})())
    got = triton_kernels.paged_attention(*args, max_query_len=1, max_seq_len=300)
    torch.testing.assert_close(got, expected, atol=ATOL[torch.float32], rtol=0)
    assert launches == []
    triton_kernels.paged_attention(*args)
    assert len(launches) == 1


# --- write_kv_cache ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_cache_stores_exactly_and_skips_padding_slots(dtype):
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 2, 64
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    # key/value as strided views of a fused projection; tokens 2 and 5 are padding.
    kv = torch.randn(7, 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads + 1:]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:7]
    slots[2] = slots[5] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expected_k, expected_v, slots)
    triton_kernels.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn])
def test_write_kv_cache_at_head_dim_80_three_kv_heads_and_block_size_1_is_exact(dtype):
    """Heads and head_dim both padded to powers of two in the kernel; int32 slots with padding."""
    gen = torch.Generator().manual_seed(9)
    kv = torch.randn(7, 7, 80, generator=gen).to(torch.float16)
    key, value = kv[:, :3], kv[:, 4:]
    slots = torch.tensor([5, 0, -1, 11, 2, -1, 7], dtype=torch.int32)
    caches = [torch.zeros(12, 1, 3, 80, dtype=dtype) for _ in range(4)]
    scales = (0.05, 0.01) if dtype.itemsize == 1 else (1.0, 1.0)
    reference.write_kv_cache(key, value, caches[0], caches[1], slots, *scales)
    triton_kernels.write_kv_cache(key, value, caches[2], caches[3], slots, *scales)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))


def test_write_kv_cache_casts_fp32_values_to_fp16_cache_exactly():
    key = torch.randn(5, 2, 8)
    value = torch.randn(5, 2, 8)
    k_cache = torch.zeros(2, 8, 2, 8, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 9, -1, 15, 3])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(key, value, expected_k, expected_v, slots)
    triton_kernels.write_kv_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_cache_rejects_mismatched_slot_mapping():
    key = torch.zeros(3, 2, 8)
    cache = torch.zeros(2, 8, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_kernels.write_kv_cache(key, key, cache, cache, torch.tensor([0, 1]))


# --- copy_blocks ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_copies_every_layer_exactly_and_nothing_else(dtype):
    gen = torch.Generator().manual_seed(8)
    shape = (10, 16, 2, 64)  # 2048 elements per block: also exercises several copy chunks
    k_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]
    v_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(3)]
    mapping = torch.tensor([[0, 7], [3, 4], [0, 9]], dtype=torch.int64)
    expected_k = [t.clone() for t in k_caches]
    expected_v = [t.clone() for t in v_caches]
    reference.copy_blocks(expected_k, expected_v, mapping)
    triton_kernels.copy_blocks(k_caches, v_caches, mapping)
    for got, want in zip(k_caches + v_caches, expected_k + expected_v):
        assert torch.equal(got, want)


def test_copy_blocks_reads_every_source_before_any_write_when_a_destination_is_also_a_source():
    """A chain and a cycle of copies: each destination gets its source's contents from before the call."""
    gen = torch.Generator().manual_seed(11)
    shape = (8, 16, 2, 64)
    k_caches = [torch.randn(shape, generator=gen) for _ in range(2)]
    v_caches = [torch.randn(shape, generator=gen) for _ in range(2)]
    before = [t.clone() for t in k_caches + v_caches]
    mapping = torch.tensor([[1, 2], [2, 3], [5, 6], [6, 5]], dtype=torch.int64)
    expected_k = [t.clone() for t in k_caches]
    expected_v = [t.clone() for t in v_caches]
    reference.copy_blocks(expected_k, expected_v, mapping)
    triton_kernels.copy_blocks(k_caches, v_caches, mapping)
    for got, want, old in zip(k_caches + v_caches, expected_k + expected_v, before):
        assert torch.equal(got, want)
        assert torch.equal(got[3], old[2]) and torch.equal(got[5], old[6]) and torch.equal(got[6], old[5])


def test_copy_blocks_with_empty_mapping_changes_nothing():
    k = [torch.randn(4, 8, 1, 8)]
    v = [torch.randn(4, 8, 1, 8)]
    before = (k[0].clone(), v[0].clone())
    triton_kernels.copy_blocks(k, v, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(k[0], before[0]) and torch.equal(v[0], before[1])


# ---- fp8 caches (`kernels.fp8`): quantizing writes, attention that dequantizes in the kernel ----

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
FP8_BATCHES = [([1, 1, 1], [1, 17, 40]),  # decode
               ([5, 1, 16], [5, 33, 50]),  # prefill, decode and extend in one batch
               ([1], [300])]  # long decode: split into partitions


@pytest.mark.parametrize("dtype", FP8)
def test_triton_write_stores_exactly_what_the_reference_stores(dtype):
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(10, 2, 8, generator=g) * 5, torch.randn(10, 2, 8, generator=g)
    key[0, 0, :4] = torch.tensor([1e9, -1e9, 0.0, 6.4])  # saturation, zero, a tie at 128 (6.4 / 0.05)
    value[1, 1, :3] = torch.tensor([1e-6, -3e-5, 2.5e-4])  # subnormals at scale 0.01
    slots = torch.tensor([3, 9, -1, 0, 31, 17, 4, 22, -1, 8])
    caches = [torch.zeros(4, 8, 2, 8, dtype=dtype) for _ in range(4)]
    reference.write_kv_cache(key, value, caches[0], caches[1], slots, 0.05, 0.01)
    triton_kernels.write_kv_cache(key, value, caches[2], caches[3], slots, 0.05, 0.01)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[0].float().count_nonzero() > 100


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("q_lens, seq_lens", FP8_BATCHES)
def test_triton_attention_on_fp8_equals_dequantize_then_attend(dtype, q_lens, seq_lens):
    args, ks, vs = fp8_batch(dtype, q_lens, seq_lens, seed=len(seq_lens))
    want = dequantize_then_attend(args, ks, vs)
    got = triton_kernels.paged_attention(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", FP8)
def test_triton_attention_on_fp8_at_head_dim_96_with_one_kv_head_equals_dequantize_then_attend(dtype):
    args, ks, vs = fp8_batch(dtype, [1, 5, 20, 1], [300, 12, 45, 2], num_heads=4, num_kv_heads=1, head_dim=96,
                             block_size=8, seed=96)
    want = dequantize_then_attend(args, ks, vs)
    got = triton_kernels.paged_attention(*args, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", FP8)
def test_scales_matter_a_wrong_scale_is_caught(dtype):
    args, ks, vs = fp8_batch(dtype, [1, 4], [9, 20])
    want = dequantize_then_attend(args, ks, vs)
    assert not torch.allclose(triton_kernels.paged_attention(*args, k_scale=ks, v_scale=2 * vs), want, atol=1e-3)


@pytest.mark.parametrize("dtype", FP8)
def test_copy_blocks_moves_fp8_blocks_byte_for_byte(dtype):
    caches = [(torch.randn(5, 4, 2, 8) * 40).to(dtype) for _ in range(4)]
    want = [c.clone() for c in caches]
    triton_kernels.copy_blocks(caches[:2], caches[2:], torch.tensor([[0, 3], [4, 1]]))
    for c, w in zip(caches, want):
        w[3], w[1] = w[0].clone(), w[4].clone()
        assert torch.equal(c.view(torch.uint8), w.view(torch.uint8))
