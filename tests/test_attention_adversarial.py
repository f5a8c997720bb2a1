"""Adversarial randomized differential tests of the CPU backend against the oracle (`kernels.reference`).

`test_batched_attention.py` holds `cpu_kernels.paged_attention` to `reference.paged_attention` on
chosen layouts; here random batches sweep what those do not: every head_dim from 1 to 256 through
each of the kernel's paths (8, 64, 128 specialized; 1-5, 12, 80, 256 generic), groups of 1 to 8
and num_heads that are not multiples of 8, block sizes 1 to 32 (3 and 5 too), sequence lengths at a
block boundary and one past, whole-sequence queries, decode/prefill/extend/idle rows in one batch,
``FUSED_MAX_QUERY_LEN`` cut low (rows split between the C kernel and the batched path), 1 to 8
threads, scores a million times larger than unit ones (exact: integer q and k, power-of-two
scales), fp8 pools with scales, block-table tails of -1, out-of-range or stale ids, pools of
exactly the blocks the batch uses, q and out as views with strided rows, and a NaN in one
sequence's K/V or past a sequence's length that must not reach any other output. Tolerance: 2e-5
of the largest |V| (float32 arithmetic on the same dequantized values, for every pool type).

Then the cases these found: scores all below -1e30 (the kernel's running max started there), a NaN
past a sequence's length in the batched path (0 x NaN in P @ V), V pools or shapes that do not
match K's (the kernel read V with K's layout and trusted the shapes), and silu_and_mul / rms_norm
at every vector tail and row stride. A one-off run of this file with the C files built with
-fsanitize=address,undefined (a CC wrapper, libasan preloaded) found no access outside a tensor.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.kernels import cpu_kernels, reference

HEAD_DIMS = [1, 2, 3, 4, 5, 8, 12, 16, 24, 64, 80, 128, 256]
POOLS = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
SENTINEL = 12345.0  # what rows no sequence owns hold before and after (the kernel must not write them)


@pytest.fixture(autouse=True, scope="module")
def _fused_kernel_builds():
    """A missing compiler would silently hold the reference to itself."""
    assert cpu_kernels.fused_available(), "cpu_attention.c did not build (is a C compiler installed?)"


@pytest.fixture
def threads():
    """Sets torch's thread count (the kernel's) for one call; restores it after the test."""
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)


def random_case(seed: int) -> dict:
    """One random batch: ``args`` (paged_attention's positional arguments, q possibly a strided view and
    with rows past query_start_loc[-1]), ``kw`` (scales, hints, out), ``fused_max`` (FUSED_MAX_QUERY_LEN
    to run with), ``threads``, ``victim`` (the sequence whose K/V holds NaN, or -1), ``rows`` (the
    batch's new tokens: rows past it belong to no sequence) and ``vmax`` (largest |V|, for the tolerance).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    head_dim = HEAD_DIMS[seed % len(HEAD_DIMS)]
    num_kv_heads = rng.choice([1, 1, 2, 3, 4, 6, 8])
    group = rng.randint(1, 8)
    if head_dim == 8 and rng.random() < 0.7:  # heads that fill vectors of eight: attend_heads8, attend_tile8
        group = rng.choice([g for g in range(1, 9) if num_kv_heads * g % 8 == 0])
    num_heads = num_kv_heads * group
    block_size = rng.choice([1, 2, 3, 5, 8, 16, 32])
    pool = rng.choice(POOLS)
    mode = rng.choice(["normal", "exact", "exact_huge", "tiny_q"])
    fused_max = rng.choice([2048, 2048, 2048, 1, 3, 16, 17])  # 16 / 17: one tile, or just past it
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["decode", "prefill", "extend", "idle"])
        seq_len = rng.randint(0, 4) * block_size + rng.choice([0, 1, -1, rng.randint(0, block_size)])
        seq_len = max(1, seq_len if rng.random() < 0.7 else rng.randint(1, 100))  # a block edge, one past, one short
        q_len = {"decode": 1, "prefill": seq_len, "idle": 0}.get(kind) or rng.randint(1, seq_len)
        q_lens.append(q_len)
        seq_lens.append(seq_len)
    if rng.random() < 0.2:  # enough (query, key) pairs for several threads: ~4K pairs each
        long = rng.choice([300, 700])
        q_lens.append(rng.choice([1, 40, long]))
        seq_lens.append(long)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq)  # the pool holds exactly the batch's blocks: a read past it is out of bounds
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    width = max(blocks_per_seq) + rng.randint(0, 3)
    # unused columns: -1, ids past the pool, any int32, or stale ids of other sequences' blocks (what the
    # worker leaves); no path may read them
    tail = rng.choice(["-1", "past", "any", "stale"])
    if tail == "any":
        tables = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(seq_lens), width), generator=gen, dtype=torch.int64)
    else:
        low, high = {"-1": (-1, 0), "past": (num_blocks, num_blocks + 100), "stale": (0, num_blocks)}[tail]
        tables = torch.randint(low, high, (len(seq_lens), width), generator=gen, dtype=torch.int64)
    tables = tables.to(torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    rows = sum(q_lens)
    v = torch.randn(shape, generator=gen)
    if mode.startswith("exact"):  # integer q and k, power-of-two scales: every score exact in any summation order
        k = torch.randint(-4, 5, shape, generator=gen).float()
        q = torch.randint(-4, 5, (rows, num_heads, head_dim), generator=gen).float()
        scale = 2.0 ** -rng.randint(0, 3)
        if mode == "exact_huge":  # scores ~1e6 apart: softmax weights of 0 and 1 (and exact ties)
            q *= 1024.0
            k *= 1024.0 if pool == torch.float32 else 1.0
    else:
        k = torch.randn(shape, generator=gen)
        q = torch.randn(rows, num_heads, head_dim, generator=gen) * (1e-30 if mode == "tiny_q" else 1.0)
        scale = head_dim ** -0.5
    kw = {}
    if pool.itemsize == 1:  # fp8: the pool holds x / scale; power-of-two k_scale keeps exact scores exact
        k_scale, v_scale = rng.choice([(1.0, 1.0), (0.5, 3.0)] + ([(0.037, 1.7)] if mode == "normal" else []))
        kw.update(k_scale=k_scale, v_scale=v_scale)
        k, v = (k / k_scale).clamp(-448, 448), (v / v_scale).clamp(-448, 448)
    nan = rng.choice(["none", "none", "victim", "past_length"])
    victim = rng.randrange(len(seq_lens)) if nan == "victim" else -1
    if victim >= 0:  # all of one sequence's K, V or both
        blocks = tables[victim, :blocks_per_seq[victim]].long()
        which = rng.choice(["k", "v", "kv"])
        if "k" in which:
            k[blocks] = float("nan")
        if "v" in which:
            v[blocks] = float("nan")
    elif nan == "past_length":  # the slots past each sequence's length in its last block: a freed block's stale data
        for i, n in enumerate(seq_lens):
            last = int(tables[i, blocks_per_seq[i] - 1])
            k[last, n - (blocks_per_seq[i] - 1) * block_size:] = float("nan")
            v[last, n - (blocks_per_seq[i] - 1) * block_size:] = float("nan")
    k_cache, v_cache = k.to(pool), v.to(pool)
    pad = rng.choice([0, 0, 2])  # rows past query_start_loc[-1]: owned by no sequence
    q = torch.cat([q, torch.zeros(pad, num_heads, head_dim)])
    if rng.random() < 0.5:  # q as a view with rows wider than a token's heads (a fused projection's slice)
        wide = torch.randn(rows + pad, num_heads, head_dim + 3, generator=gen)
        wide[..., :head_dim] = q
        q = wide[..., :head_dim]
    out = rng.choice(["none", "contiguous", "strided"])
    if out == "contiguous":
        kw["out"] = torch.full(q.shape, SENTINEL)
    elif out == "strided":
        kw["out"] = torch.full((rows + pad, num_heads, head_dim + 1), SENTINEL)[..., :head_dim]
    if rng.random() < 0.5:
        kw.update(max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    vmax = float(torch.nan_to_num(v_cache.float(), nan=0.0).abs().max()) * kw.get("v_scale", 1.0)
    return dict(args=(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), qsl, scale), kw=kw,
                fused_max=fused_max, threads=rng.choice([1, 2, 3, 8]), victim=victim, rows=rows, vmax=vmax)


@pytest.mark.parametrize("first", range(0, 260, 26))  # 260 random batches, 20 per head_dim, in 10 runs
def test_cpu_attention_equals_the_oracle_on_adversarial_random_batches(first, monkeypatch, threads):
    for seed in range(first, first + 26):
        case = random_case(seed)
        args, kw, rows, victim = case["args"], case["kw"], case["rows"], case["victim"]
        scales = {name: kw[name] for name in ("k_scale", "v_scale") if name in kw}
        expected = reference.paged_attention(*args, **scales)
        monkeypatch.setattr(cpu_kernels, "FUSED_MAX_QUERY_LEN", case["fused_max"])
        threads(case["threads"])
        got = cpu_kernels.paged_attention(*args, **kw)
        context = f"seed {seed}: {args[1].shape} {args[1].dtype}, q_lens {args[5].diff().tolist()}, " \
                  f"seq_lens {args[4].tolist()}, fused_max {case['fused_max']}, threads {case['threads']}"
        if "out" in kw:
            assert got is kw["out"], context
        keep = torch.ones(rows, dtype=torch.bool)  # rows of sequences whose K/V hold no NaN
        if victim >= 0:
            keep[int(args[5][victim]):int(args[5][victim + 1])] = False
        assert expected[:rows][keep].isfinite().all(), context  # the oracle reads no slot past a length
        assert got[:rows][keep].isfinite().all(), context  # nor may the backend, nor another sequence's blocks
        torch.testing.assert_close(got[:rows][keep], expected[:rows][keep], rtol=0,
                                   atol=2e-5 * max(1.0, case["vmax"]), msg=lambda m: f"{context}\n{m}")
        if "out" in kw:  # the kernel writes only the rows of its sequences
            assert (got[rows:] == SENTINEL).all(), context


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads, q_len", [
    (8, 8, 8, 1),  # attend_heads8
    (8, 8, 4, 5),  # attend_tile8
    (16, 4, 1, 1),  # the tile path for a lone token (head_dim <= 4 x group)
    (24, 6, 3, 7),  # the tile path, generic head_dim
    (64, 2, 2, 1),  # the per-token path
])
def test_fused_kernel_with_every_score_below_minus_1e30_equals_the_oracle(head_dim, num_heads, num_kv_heads, q_len):
    # |score| > 1e30 is float32 still: softmax must pick each query's largest score, not average V
    # uniformly (as a running max that starts at -1e30, or masked keys set to -1e30, would)
    gen = torch.Generator().manual_seed(head_dim + q_len)
    k_cache = (torch.rand(3, 4, num_kv_heads, head_dim, generator=gen) + 0.5) * 1e16
    v_cache = torch.randn(3, 4, num_kv_heads, head_dim, generator=gen)
    q = -(torch.rand(q_len, num_heads, head_dim, generator=gen) + 0.5) * 1e16
    args = (q, k_cache, v_cache, torch.tensor([[2, 0, 1]], dtype=torch.int32), torch.tensor([10], dtype=torch.int32),
            torch.tensor([0, q_len], dtype=torch.int32), 0.25)
    torch.testing.assert_close(cpu_kernels.paged_attention(*args), reference.paged_attention(*args), atol=1e-5, rtol=0)


@pytest.mark.parametrize("where", ["past_length", "padding_0", "padding_-1"])
def test_the_batched_path_keeps_a_nan_past_a_sequences_length_out_of_its_output(where):
    # Sequences of one chunk are gathered to the longest's length and masked: the weights of slots
    # past a sequence's length are 0, but 0 x NaN is NaN in the P @ V product. A freed block keeps its
    # last owner's K/V (past_length), and table columns past a length hold 0 (the worker's fill), stale
    # ids or -1 (clamped to block 0) of blocks other sequences own: a NaN there reached the output.
    gen = torch.Generator().manual_seed(18)
    k_cache, v_cache = torch.randn(4, 4, 2, 8, generator=gen), torch.randn(4, 4, 2, 8, generator=gen)
    if where == "past_length":  # sequence 0: 5 tokens in blocks 0 and 1, NaN in slots 5..7
        tables, seq_lens = [[0, 1], [2, 3]], [5, 8]
        v_cache[1, 1:] = float("nan")
    else:  # sequence 0: 3 tokens in block 1; block 0 belongs to another request, NaN
        tables, seq_lens = [[1, int(where[8:])], [2, 3]], [3, 8]
        v_cache[0] = float("nan")
    args = (torch.randn(6, 4, 8, generator=gen), k_cache, v_cache, torch.tensor(tables, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32), 8 ** -0.5)
    expected = reference.paged_attention(*args)
    assert expected.isfinite().all()
    torch.testing.assert_close(reference.batched_paged_attention(*args), expected, atol=1e-5, rtol=0)  # torch backend
    torch.testing.assert_close(cpu_kernels.paged_attention(*args), expected, atol=1e-5, rtol=0)  # fused


def test_rows_past_the_fused_limit_keep_a_nan_block_of_another_sequence_out(monkeypatch):
    # the cpu backend's own batched rows (prefill chunks past FUSED_MAX_QUERY_LEN), a short prompt
    # beside a longer one: its padding columns (0, the worker's initial fill) name a NaN block
    monkeypatch.setattr(cpu_kernels, "FUSED_MAX_QUERY_LEN", 2)
    gen = torch.Generator().manual_seed(19)
    k_cache, v_cache = torch.randn(6, 4, 2, 8, generator=gen), torch.randn(6, 4, 2, 8, generator=gen)
    v_cache[0] = float("nan")  # block 0: a third sequence's, idle this step
    tables = torch.tensor([[1, 0, 0, 0], [2, 3, 4, 5], [0, 0, 0, 0]], dtype=torch.int32)
    args = (torch.randn(3 + 16, 4, 8, generator=gen), k_cache, v_cache, tables,
            torch.tensor([3, 16, 4], dtype=torch.int32), torch.tensor([0, 3, 19, 19], dtype=torch.int32), 8 ** -0.5)
    expected = reference.paged_attention(*args)
    assert expected.isfinite().all()
    torch.testing.assert_close(cpu_kernels.paged_attention(*args), expected, atol=1e-5, rtol=0)


def test_a_v_pool_the_kernel_cannot_read_in_place_takes_the_reference():
    # the wrapper checked k_cache's layout alone: a strided V (K and V interleaved per slot) or a V of
    # another element type was read as if it were K's, giving wrong results (and reading past V)
    gen = torch.Generator().manual_seed(20)
    kv = torch.randn(4, 4, 2, 2, 8, generator=gen)  # [blocks, slots, K or V, kv_heads, head_dim]
    k_cache, v_strided = kv[:, :, 0].contiguous(), kv[:, :, 1]
    rest = (torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 8], dtype=torch.int32),
            torch.tensor([0, 1, 4], dtype=torch.int32), 8 ** -0.5)
    q = torch.randn(4, 4, 8, generator=gen)
    for v_cache in (v_strided, v_strided.contiguous().to(torch.bfloat16)):
        torch.testing.assert_close(cpu_kernels.paged_attention(q, k_cache, v_cache, *rest),
                                   reference.paged_attention(q, k_cache, v_cache, *rest), atol=1e-5, rtol=0)


def test_a_v_pool_smaller_than_k_is_refused_not_read_past():
    # V with fewer blocks than K: block 3 is inside K's pool but past V's; the kernel bounds block ids
    # by K's pool. V is a view of a larger tensor, so that reading past it stays in owned memory.
    gen = torch.Generator().manual_seed(21)
    k_cache, v_larger = torch.randn(4, 4, 2, 8, generator=gen), torch.randn(4, 4, 2, 8, generator=gen)
    args = (torch.randn(2, 4, 8, generator=gen), k_cache, v_larger[:2], torch.tensor([[0, 3]], dtype=torch.int32),
            torch.tensor([8], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), 8 ** -0.5)
    with pytest.raises(IndexError):
        reference.paged_attention(*args)
    with pytest.raises(IndexError):
        cpu_kernels.paged_attention(*args)


@pytest.mark.parametrize("mismatch", ["head_dim", "heads", "table_rows"])
def test_inconsistent_shapes_raise_as_in_the_reference_instead_of_reaching_the_kernel(mismatch):
    # q's head_dim not the pool's, num_heads not a multiple of num_kv_heads, fewer table rows than
    # sequences: the kernel trusted these (reading K/V rows of q's width, or a next table row). The
    # pools and tables are views of larger tensors, so that reading past them stays in owned memory.
    gen = torch.Generator().manual_seed(22)
    k_cache, v_cache = torch.randn(9, 4, 2, 8, generator=gen)[:3], torch.randn(9, 4, 2, 8, generator=gen)[:3]
    tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    q = torch.randn(3, {"heads": 3}.get(mismatch, 4), 16 if mismatch == "head_dim" else 8, generator=gen)
    if mismatch == "table_rows":
        tables = tables[:1]
    args = (q, k_cache, v_cache, tables, torch.tensor([6, 3], dtype=torch.int32),
            torch.tensor([0, 1, 3], dtype=torch.int32), 8 ** -0.5)
    with pytest.raises((IndexError, RuntimeError)):
        reference.paged_attention(*args)
    with pytest.raises((IndexError, RuntimeError)):
        cpu_kernels.paged_attention(*args)


def test_write_kv_cache_into_a_v_pool_smaller_than_k_writes_nothing_past_it():
    # slots were bounded by K's pool alone: slot 9 (block 2) was written past V's two blocks
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    k_cache, v_larger = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    v_cache = v_larger[:2]  # V's pool: two blocks, a view, so that a write past it stays in owned memory
    with pytest.raises(IndexError):
        reference.write_kv_cache(k, v, k_cache.clone(), v_cache.clone(), torch.tensor([0, 9, 5]))
    with pytest.raises(IndexError):
        cpu_kernels.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 9, 5]))
    assert (v_larger[2:] == 0).all()  # nothing past V's pool


@pytest.mark.parametrize("width", [*range(1, 34), 63, 65, 255, 257])  # every tail of 8- and 16-lane vectors
def test_silu_and_mul_and_rms_norm_on_odd_widths_and_row_strides(width):
    gen = torch.Generator().manual_seed(width)
    for extra in (0, 1, 5):  # rows of a wider tensor, each starting at an odd offset when extra is odd
        x = (torch.randn(7, 2 * width + extra, generator=gen) * 10)[:, :2 * width]
        torch.testing.assert_close(cpu_kernels.silu_and_mul(x), reference.silu_and_mul(x), atol=1e-6, rtol=1e-5)
        for dtype in (torch.float32, torch.bfloat16):
            rows = (torch.randn(7, width + extra, generator=gen) * 3).to(dtype)[:, :width]
            weight = torch.randn(width, generator=gen).to(dtype)
            got, want = cpu_kernels.rms_norm(rows, weight, 1e-5), reference.rms_norm(rows, weight, 1e-5)
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
            else:  # two units in the last place at most (see test_cpu_ops.py)
                assert (got.view(torch.int16).int() - want.view(torch.int16).int()).abs().max() <= 2
