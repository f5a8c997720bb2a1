"""Paged attention in Triton: split-K decode plus a query-tiled prefill/extend kernel.

Same signature and semantics as `kernels.reference.paged_attention`. One call serves a mixed batch
without a host sync: every call launches

1. `_decode_kernel` over (sequence, kv head, context partition). Only sequences with q_len == 1
   do work (Flash-Decoding, Dao et al. 2023: split the context so that few, long sequences still
   fill the GPU). A sequence whose context fits one partition writes its output directly; others
   write partial (max, sum, unnormalised acc) rows that
2. `_decode_reduce_kernel` merges (log-sum-exp rescaling), launched only when some sequence can
   span more than one partition.
3. `_prefill_kernel` over (query tile, kv head). Only sequences with q_len > 1 do work
   (FlashAttention-2, Dao 2023, Algorithm 1: query tiles stay on chip, K/V tiles stream through
   with online softmax). A tile holds BLOCK_Q tokens × the head group of one KV head, so under
   GQA each K/V tile is loaded once for all query heads that share it. Programs find their
   sequence by binary search over ``query_start_loc``; the grid is an upper bound computed from
   shapes alone, surplus programs exit at once.

Both attention kernels gather K/V token rows through the block table (PagedAttention, Kwon et
al. 2023, section 4.1), so one K/V tile (TILE_N tokens) may span several physical blocks and its
size is independent of block_size. Head groups and head_dim are padded to powers of two so that
``tl.dot`` sees dimensions >= 16; the padding is masked. Scores use ``exp2`` with ``scale * log2(e)`` folded in; softmax
statistics and accumulators are fp32.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256
# The reduce kernel holds every partition's partial row in registers; this bounds it.
_MAX_PARTITIONS = 64
# Split-K partition length bounds, in K/V tiles (see `_decode_split`).
_MIN_PARTITION_TILES = 4
_MAX_PARTITION_TILES = 32


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    # Interpreter on CPU: small, so that the tests exercise the split-K path on small batches.
    return 16


@triton.jit
def _mma(a, b, F32: tl.constexpr):
    """a @ b with fp32 accumulation.

    F32: multiply in IEEE fp32. Used for fp32 caches (TF32 would cost ~1e-3 relative error) and
    under the interpreter, whose bf16 matmul is wrong. Otherwise a is cast to b's dtype (q to the
    cache dtype, probabilities to V's dtype, as FlashAttention-2 does) for the tensor cores.
    """
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit(do_not_specialize=["num_partitions", "partition"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    qk_scale, v_scale, num_heads, num_partitions, partition,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, F32: tl.constexpr, FP8: tl.constexpr,
):
    """One program: one decode sequence, one KV head (its GROUP query heads), one partition.

    ``partition`` (tokens, a multiple of TILE_N) is a runtime value: it follows the batch size,
    and a constexpr would recompile the kernel whenever that changes.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = part * partition
    if (q_len != 1) | (ctx_start >= seq_len):
        return
    ctx_end = tl.minimum(seq_len, ctx_start + partition)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g

    # Rows beyond GROUP are zero padding so tl.dot gets M >= 16.
    q = tl.load(q_ptr + q_start.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :] * stride_qd, mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for start in range(ctx_start, ctx_end, TILE_N):
        pos = start + offs_n
        n_mask = pos < ctx_end
        blk = tl.load(block_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot_k = blk * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        slot_v = blk * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + slot_k[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot_v[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if FP8:  # dequantize: exact in q's dtype; k_scale is in qk_scale, v_scale applied to acc
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = _mma(q, tl.trans(k), F32) * qk_scale  # [GROUP_PAD, TILE_N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile has a valid token
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _mma(p, v, F32)
        m_i = m_new
    acc = acc * v_scale  # partial accumulators combine linearly: scaling each scales the result

    if seq_len <= partition:
        # The whole context fit one partition: final output, no reduce needed.
        o = acc / l_i[:, None]
        tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :] * stride_od, o.to(out_ptr.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])
    else:
        row = (seq.to(tl.int64) * num_heads + heads) * num_partitions + part
        tl.store(part_m_ptr + row, m_i, mask=g_mask)
        tl.store(part_l_ptr + row, l_i, mask=g_mask)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc,
                 mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_partitions", "partition"])
def _decode_reduce_kernel(
    out_ptr, seq_lens_ptr, query_start_loc_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    num_heads, num_partitions, partition,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PARTS_PAD: tl.constexpr,
):
    """One program: one decode sequence, one query head. Merges the partitions' partial softmax."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    n_parts = tl.cdiv(seq_len, partition)
    if (q_len != 1) | (n_parts <= 1):
        return  # not decode, or already written by _decode_kernel

    offs_p = tl.arange(0, PARTS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    p_mask = offs_p < n_parts
    row = (seq.to(tl.int64) * num_heads + head) * num_partitions + offs_p
    m = tl.load(part_m_ptr + row, mask=p_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=p_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                  mask=p_mask[:, None], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))  # masked partitions: exp2(-inf) = 0
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_tile(
    acc, m_i, l_i, q, q_pos, start, kv_end, offs_n, offs_d, d_mask,
    block_row, k_ptr, v_ptr, kv_head,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    qk_scale,
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, F32: tl.constexpr, FP8: tl.constexpr,
):
    """One K/V tile of the FlashAttention-2 inner loop. CAUSAL=False for tiles every row sees."""
    pos = start + offs_n
    blk = tl.load(block_row + pos // BLOCK_SIZE, mask=pos < kv_end, other=0).to(tl.int64)
    slot_k = blk * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
    slot_v = blk * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
    kv_mask = (pos < kv_end)[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + slot_k[:, None] + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + slot_v[:, None] + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if FP8:  # dequantize (see _decode_kernel)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = _mma(q, tl.trans(k), F32) * qk_scale  # [BLOCK_M, TILE_N], log2 units
    if CAUSAL:
        visible = (pos[None, :] <= q_pos[:, None]) & (pos < kv_end)[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: each row saw position 0 in its first tile
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p, v, F32)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, v_scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, F32: tl.constexpr, FP8: tl.constexpr,
):
    """One program: BLOCK_Q query tokens × the GROUP query heads of one KV head, of one sequence.

    Sequence i owns programs ``query_start_loc[i] // BLOCK_Q + i`` onwards; that leaves room for
    its ``cdiv(q_len_i, BLOCK_Q)`` tiles, so ``num_tokens // BLOCK_Q + num_seqs`` programs cover
    any batch without reading lengths on the host.
    """
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Largest seq with query_start_loc[seq] // BLOCK_Q + seq <= pid.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_tile = pid - (q_start // BLOCK_Q + seq)
    if (q_len <= 1) | (q_tile * BLOCK_Q >= q_len):
        return  # decode sequences belong to _decode_kernel; surplus programs
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_before = seq_len - q_len  # cached prefix (extend) before the new tokens

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # row -> token within the sequence
    head_in_group = offs_m % GROUP_PAD
    row_mask = (tok < q_len) & (head_in_group < GROUP)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + head_in_group
    q_off = (q_start + tok).to(tl.int64) * stride_qt + heads * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :] * stride_qd,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = ctx_before + tok  # absolute position of each row's token

    first_pos = ctx_before + q_tile * BLOCK_Q
    kv_end = tl.minimum(seq_len, first_pos + BLOCK_Q)
    # Tiles wholly at or before the tile's first query position need no causal mask.
    full_end = (first_pos + 1) // TILE_N * TILE_N
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for start in range(0, full_end, TILE_N):
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, q_pos, start, kv_end, offs_n, offs_d, d_mask, block_row,
            k_ptr, v_ptr, kv_head, stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd, qk_scale, BLOCK_SIZE, False, F32, FP8)
    for start in range(full_end, kv_end, TILE_N):
        acc, m_i, l_i = _prefill_tile(
            acc, m_i, l_i, q, q_pos, start, kv_end, offs_n, offs_d, d_mask, block_row,
            k_ptr, v_ptr, kv_head, stride_kb, stride_kt, stride_kh, stride_kd,
            stride_vb, stride_vt, stride_vh, stride_vd, qk_scale, BLOCK_SIZE, True, F32, FP8)

    o = acc * v_scale / l_i[:, None]
    o_off = (q_start + tok).to(tl.int64) * stride_ot + heads * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# Decided when the kernels were decorated (TRITON_INTERPRET=1 at import), not at call time.
_INTERPRETED = isinstance(_decode_kernel, InterpretedFunction)


def _decode_split(num_seqs: int, num_kv_heads: int, max_context: int, tile_n: int,
                  num_sms: int) -> tuple[int, int]:
    """(partition size in tokens, number of partitions) for the split-K decode.

    By occupancy: ~4 programs per SM over (sequence, kv head, partition). By context length: a
    program walks at most ``_MAX_PARTITION_TILES`` K/V tiles (long contexts split even in big
    batches, bounding the longest program), and a partition holds at least ``_MIN_PARTITION_TILES``
    tiles (short contexts are not split: the reduce would cost more than it saves).
    ``max_context`` bounds every sequence's context, in tokens. Partitions are whole K/V tiles.
    """
    max_tiles = triton.cdiv(max_context, tile_n)
    wanted = max(triton.cdiv(4 * num_sms, num_seqs * num_kv_heads), triton.cdiv(max_tiles, _MAX_PARTITION_TILES))
    parts = max(1, min(wanted, _MAX_PARTITIONS, max_tiles // _MIN_PARTITION_TILES))
    partition = triton.cdiv(max_tiles, parts) * tile_n
    return partition, triton.cdiv(max_context, partition)


def warm_up_split_k_reduce(num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> list[int]:
    """Compile `_decode_reduce_kernel` for every partition count `_decode_split` can choose, so none
    compiles mid-serving: its ``PARTS_PAD`` (a power of two, 2 to ``_MAX_PARTITIONS``) follows the
    batch's size and context, and a warm-up decode meets one. One decode sequence of length 1 per
    launch (the kernel returns at once; only the compile matters). ``num_heads`` (this rank's),
    ``head_dim`` and ``dtype`` (the attention output's) are those of serving, as the kernel is
    specialized on them. Returns the PARTS_PAD values launched.
    """
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    out = torch.empty(1, num_heads, head_dim, dtype=dtype, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, 1], dtype=torch.int32, device=device)
    launched = []
    parts = 2
    while parts <= _MAX_PARTITIONS:
        part_m = torch.zeros(1, num_heads, parts, dtype=torch.float32, device=device)
        part_acc = torch.zeros(1, num_heads, parts, head_dim_pad, dtype=torch.float32, device=device)
        _decode_reduce_kernel[(1, num_heads)](
            out, seq_lens, query_start_loc, part_m, part_m, part_acc, num_heads, parts, 1, *out.stride(),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PARTS_PAD=parts, num_warps=4)
        launched.append(parts)
        parts *= 2
    return launched


def _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out):
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim] and k_cache "
                         f"[num_blocks, block_size, num_kv_heads, head_dim]; got q {tuple(q.shape)}, "
                         f"k_cache {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} must match k_cache "
                         f"{tuple(k_cache.shape)} {k_cache.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if head_dim > _MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} > {_MAX_HEAD_DIM} is not supported")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q dtype {q.dtype} is not one of fp32, fp16, bf16")
    if k_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"k_cache dtype {k_cache.dtype} is not one of fp32, fp16, bf16, fp8 (e4m3, e5m2)")
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if (block_tables.dim() != 2 or seq_lens.dim() != 1 or block_tables.shape[0] != num_seqs
            or query_start_loc.shape != (num_seqs + 1,)):
        raise ValueError(f"need block_tables [num_seqs, max_blocks], seq_lens [num_seqs], "
                         f"query_start_loc [num_seqs + 1]; got {tuple(block_tables.shape)}, "
                         f"{tuple(seq_lens.shape)}, {tuple(query_start_loc.shape)}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 (or int64), got {t.dtype}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if out is not None and (out.shape != q.shape or out.device != q.device):
        raise ValueError(f"out {tuple(out.shape)} on {out.device} must match q "
                         f"{tuple(q.shape)} on {q.device}")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of new query tokens over each sequence's paged context (Triton).

    q: ``[num_tokens, num_heads, head_dim]`` fp32/fp16/bf16, any strides (e.g. a view of a fused
    QKV projection). k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, same
    dtype, already holding the new tokens' K/V. block_tables ``[num_seqs, max_blocks_per_seq]``,
    seq_lens ``[num_seqs]`` (context length including new tokens), query_start_loc
    ``[num_seqs + 1]`` (cumulative new-token counts): int32. scale: softmax scale, usually
    ``head_dim ** -0.5``. New token j of sequence i sees positions ``0 .. seq_lens[i] - q_len_i + j``.
    Sequences with q_len 1 take the split-K decode path, q_len > 1 the prefill path, q_len 0
    nothing; all in one call. head_dim <= 256; num_heads a multiple of num_kv_heads (GQA).
    Returns ``[num_tokens, num_heads, head_dim]`` in q's dtype, or writes ``out`` (any float dtype).
    max_query_len: when 1, the prefill/extend kernel is not launched (a decode-only step).
    max_seq_len: an upper bound of every seq_len, used to size split-K by context length (else
    ``max_blocks_per_seq * block_size``); a bound below a real seq_len drops context silently.
    fp8 caches (float8_e4m3fn / float8_e5m2, `kernels.fp8`) are dequantized inside the kernels: each
    K/V tile is widened to q's dtype (exact), k_scale folds into the softmax scale and v_scale into
    the output. Native fp8 loads need a GPU with fp8 support in Triton (sm_89+ for e4m3).

    Raises ValueError on inconsistent shapes, dtypes or devices. Lengths are not checked on the
    host (that would sync); seq_lens[i] >= q_len_i and enough block-table columns are the
    caller's contract, as in the reference.
    """
    _check_attention_args(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    f32 = _INTERPRETED or k_cache.dtype == torch.float32
    fp8 = k_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    qk_scale = float(scale) * _LOG2E * (float(k_scale) if fp8 else 1.0)
    v_scale = float(v_scale) if fp8 else 1.0
    big_head = head_dim_pad > 128
    common_strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
                      block_tables.stride(0))

    # Decode: Flash-Decoding split-K, then a reduce over partitions.
    tile_n = 32 if big_head else 64
    max_context = block_tables.shape[1] * block_size if max_seq_len is None else max(1, max_seq_len)
    partition, num_partitions = _decode_split(num_seqs, num_kv_heads, max_context, tile_n, _num_sms(q.device))
    if num_partitions > 1:
        part_m = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_seqs, num_heads, num_partitions, head_dim_pad,
                               dtype=torch.float32, device=q.device)
    else:  # never touched: every decode sequence fits its single partition
        part_m = part_l = part_acc = torch.empty(1, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        part_m, part_l, part_acc, qk_scale, v_scale, num_heads, num_partitions, partition, *common_strides,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, TILE_N=tile_n,
        F32=f32, FP8=fp8, num_warps=4, num_stages=2 if big_head else 3)
    if num_partitions > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, seq_lens, query_start_loc, part_m, part_l, part_acc, num_heads, num_partitions,
            partition, *out.stride(), HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            PARTS_PAD=triton.next_power_of_2(num_partitions), num_warps=4)

    if max_query_len == 1:
        return out  # decode-only step: no prefill/extend program would do any work
    # Prefill / extend: FlashAttention-2 query tiles of BLOCK_M = BLOCK_Q × GROUP_PAD rows.
    group_pad = triton.next_power_of_2(group)
    block_m = max(64 if big_head else 128, group_pad)
    block_q = block_m // group_pad
    tile_n = 32 if big_head else 64
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        qk_scale, v_scale, num_seqs, *common_strides,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, TILE_N=tile_n,
        F32=f32, FP8=fp8, num_warps=8 if head_dim_pad >= 128 else 4,
        num_stages=1 if k_cache.dtype == torch.float32 else 2)  # fp32 tiles: bound shared memory
    return out
