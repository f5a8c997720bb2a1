"""PyTorch implementations: the per-sequence oracle, the batched CPU attention and the cache ops.

`paged_attention` loops over sequences and is the oracle every backend is tested against;
`batched_paged_attention` computes the same thing for the whole batch in a few tensor ops (the
CPU path of `kernels.paged_attention`).

Layout (vLLM V1 flash backend): a KV cache is one tensor per layer for K and one for V, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a sequence lives in physical
block ``block_table[t // block_size]`` at offset ``t % block_size``; its slot is
``block_id * block_size + offset`` (PagedAttention, Kwon et al., SOSP 2023, section 4.1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedkv.kernels import fp8


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
    """Causal attention of new query tokens over each sequence's paged context.

    q: ``[num_tokens, num_heads, head_dim]``, the new tokens of all sequences, concatenated.
    k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, already holding the
    new tokens' K/V (call `write_kv_cache` first).
    block_tables: ``[num_seqs, max_blocks_per_seq]`` int32, physical block ids (padding unused).
    seq_lens: ``[num_seqs]`` int32, each sequence's context length including its new tokens.
    query_start_loc: ``[num_seqs + 1]`` int32, cumulative new-token counts (q_len_i = diff).
    New token j of sequence i attends to context positions ``0 .. seq_lens[i] - q_len_i + j``.
    GQA: num_heads must be a multiple of num_kv_heads; head h reads kv head h // (num_heads // num_kv_heads).
    max_query_len, max_seq_len: hints other backends use (see `kernels.triton_kernels`); ignored here.
    Accumulates in fp32; returns ``[num_tokens, num_heads, head_dim]`` in q's dtype (into ``out`` if given).
    fp8 caches (`kernels.fp8`): K and V are dequantized (x k_scale, x v_scale) before attending.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_tables[i, :num_blocks].long()
        k = fp8.dequantize(k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len], k_scale)
        v = fp8.dequantize(v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len], v_scale)
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        qi = q[q_start:q_end].float()  # [q_len, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        # query j sits at absolute position seq_len - q_len + j
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]
        scores.masked_fill_(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out


# Elements of one gathered K (or V) chunk in `batched_paged_attention`: bounds its temporary memory.
_GATHER_BUDGET = 1 << 24
# A chunk may pad up to 2x its useful elements, or any amount below this many (small sequences batch together).
_SMALL_CHUNK = 1 << 16


def batched_paged_attention(
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
    fused_max_query_len: int = 0,
) -> torch.Tensor:
    """`paged_attention` for a whole batch at once, with no Python loop over sequences.

    Same arguments, semantics and result as `paged_attention` (the oracle), on any device.
    max_query_len and max_seq_len are accepted for parity with the Triton backend and unused.
    fp8 caches (`kernels.fp8`): each chunk's gathered K and V are dequantized (x k_scale, x v_scale)
    as the oracle does, then attended in fp32.
    fused_max_query_len: rows of sequences with 1 <= q_len <= it are left untouched:
    `kernels.cpu_kernels` writes those with its fused kernel and calls this for the rest.
    Sequences are split into decode (q_len 1) and prefill/extend (q_len > 1) groups, each sorted by
    context length and cut into chunks (`_chunks`) of at most ``_GATHER_BUDGET`` gathered K (or
    score) elements that pad at most 2x their useful elements; a chunk gathers its K/V through the
    block table into ``[seqs, ctx, kv_heads, head_dim]``, pads its queries to
    ``[seqs, max_q, heads, head_dim]`` and runs one masked batched softmax(QK^T)V in fp32.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - starts
    seq_lens = seq_lens.long()
    q_lens = torch.where(q_lens <= fused_max_query_len, 0, q_lens)  # rows the caller computes: idle here
    for group in ((q_lens == 1).nonzero().squeeze(1), (q_lens > 1).nonzero().squeeze(1)):
        if group.numel() == 0:
            continue
        group = group[seq_lens[group].argsort()]
        for first, last, max_q in _chunks(q_lens[group].tolist(), seq_lens[group].tolist(),
                                          num_kv_heads * head_dim, num_heads):
            seqs = group[first:last]
            _attend(q, k_cache, v_cache, block_tables[seqs], seq_lens[seqs], starts[seqs], q_lens[seqs],
                    max_q, scale, out, k_scale, v_scale)
    return out


def _chunks(q_lens: list[int], seq_lens: list[int], kv_width: int, num_heads: int) -> list[tuple[int, int, int]]:
    """Cut sequences (sorted by context) into chunks ``(first, last, max_q)`` for `_attend`.

    A sequence of q new tokens and c context tokens needs ``max(kv_width, num_heads x q) x c``
    elements (gathered K, or scores); a chunk pads every member to its largest q and c. A chunk
    grows while its padded size stays within ``_GATHER_BUDGET`` and within twice its members'
    own sizes (or under ``_SMALL_CHUNK``): one long prompt does not pad many short ones to its length.
    """
    def size(q: int, c: int) -> int:
        return max(kv_width, num_heads * q) * max(1, c)

    chunks, first = [], 0
    while first < len(q_lens):
        max_q, max_c, useful, last = q_lens[first], seq_lens[first], size(q_lens[first], seq_lens[first]), first + 1
        while last < len(q_lens):
            q, c = max(max_q, q_lens[last]), max(max_c, seq_lens[last])
            padded, more = (last + 1 - first) * size(q, c), useful + size(q_lens[last], seq_lens[last])
            if padded > _GATHER_BUDGET or (padded > 2 * more and padded > _SMALL_CHUNK):
                break
            max_q, max_c, useful, last = q, c, more, last + 1
        chunks.append((first, last, max_q))
        first = last
    return chunks


def _attend(q, k_cache, v_cache, tables, seq_lens, starts, q_lens, max_q, scale, out, k_scale, v_scale) -> None:
    """One chunk of `batched_paged_attention`: padded, masked attention of ``len(seq_lens)`` sequences."""
    num_seqs = seq_lens.shape[0]
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    ctx = int(seq_lens.max())
    num_blocks = -(-ctx // block_size)
    # columns past a sequence's length may hold anything (-1, an id past the pool): never gathered
    used = torch.arange(num_blocks, device=tables.device)[None, :] * block_size < seq_lens[:, None]
    blocks = torch.where(used, tables[:, :num_blocks].long(), 0).clamp_min(0)
    k = fp8.dequantize(k_cache[blocks], k_scale).view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    v = fp8.dequantize(v_cache[blocks], v_scale).view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    # slots past a sequence's length (a freed block's stale data, or other sequences' blocks named by
    # the padding) weigh 0, but 0 x NaN is NaN in P @ V: zeroed, so no NaN there reaches the output
    past = torch.arange(k.shape[1], device=q.device)[None, :] >= seq_lens[:, None]  # [seqs, ctx]
    v.masked_fill_(past[:, :, None, None], 0.0)  # v: the gather's float32 copy, not the pool
    j = torch.arange(max_q, device=q.device)
    valid = j[None, :] < q_lens[:, None]  # [seqs, max_q]
    rows = torch.where(valid, starts[:, None] + j[None, :], 0)
    # [seqs, kv_heads, group * max_q, head_dim]: one matmul per (sequence, kv head) serves its whole group
    qs = q[rows].view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qs = qs.reshape(num_seqs, num_kv_heads, group * max_q, head_dim).float()
    scores = torch.matmul(qs, k.float().permute(0, 2, 3, 1)).mul_(scale)  # [seqs, kv_heads, group * max_q, ctx]
    q_pos = (seq_lens - q_lens)[:, None] + j[None, :]  # absolute position of each query
    hidden = torch.arange(k.shape[1], device=q.device)[None, None, :] > q_pos[:, :, None]  # [seqs, max_q, ctx]
    scores.view(num_seqs, num_kv_heads, group, max_q, -1).masked_fill_(hidden[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v.float().permute(0, 2, 1, 3))  # [seqs, kv_heads, group * max_q, head_dim]
    o = o.view(num_seqs, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)  # [seqs, max_q, kv, g, d]
    out[rows[valid]] = o[valid].view(-1, num_heads, head_dim).to(out.dtype)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store new tokens' K and V into their slots, in place.

    key, value: ``[num_tokens, num_kv_heads, head_dim]``; k_cache, v_cache:
    ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot_mapping: ``[num_tokens]`` int64,
    slot = block_id * block_size + offset, -1 = skip (padding). Values are cast to the cache dtype;
    into an fp8 cache they are quantized, ``x / k_scale`` (``x / v_scale``) saturated (`kernels.fp8`).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if fp8.is_fp8(k_cache.dtype):
        k, v = fp8.quantize(key[keep], k_scale, k_cache.dtype), fp8.quantize(value[keep], v_scale, v_cache.dtype)
    else:
        k, v = key[keep].to(k_cache.dtype), value[keep].to(v_cache.dtype)
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm (Zhang & Sennrich 2019) over the last dimension, in float32 like HF's LlamaRMSNorm.

    x: ``[num_tokens, hidden_size]`` of the model's dtype; weight: ``[hidden_size]``. Returns a new
    tensor of x's shape: ``weight * (x / sqrt(mean(x^2) + eps))``, the norm computed in float32.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation (Shazeer 2020): ``silu(gate) * up`` for x = [gate | up].

    x: ``[num_tokens, 2 * intermediate_size]``, the fused gate/up projection's output (gate first).
    Returns a new ``[num_tokens, intermediate_size]`` tensor of x's dtype.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (Su et al. 2021, RoFormer, section 3.4.2) of q and k; returns new tensors.

    q: ``[num_tokens, num_heads, head_dim]``, k: ``[num_tokens, num_kv_heads, head_dim]``; cos, sin:
    ``[num_tokens, head_dim // 2]`` float32, each token's angles. HF's rotate_half layout: dimension
    i pairs with i + head_dim/2. Computed in float32, returned in q's and k's dtype.
    """
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def copy_blocks(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks within each layer's caches, in place (copy-on-write).

    k_caches, v_caches: one ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.
    block_mapping: ``[n, 2]`` int64 of (src, dst) physical block ids; dst blocks are distinct.
    """
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(k_caches[0].device)
    dst = block_mapping[:, 1].to(k_caches[0].device)
    for k_cache, v_cache in zip(k_caches, v_caches):
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks between two pools that may live on different devices (swap preemption).

    src, dst: ``[num_blocks, ...]`` caches of one layer's K or V (device pool and host pool).
    block_mapping: ``[n, 2]`` int64 of (src block, dst block). On CUDA, with a pinned host pool,
    the copies are non-blocking on the current stream. One copy per block, straight into the
    destination view: a gathered temporary copied device->host without blocking would be read on
    the host before its DMA finished.
    """
    non_blocking = src.device.type != dst.device.type
    for s, d in block_mapping.tolist():
        dst[d].copy_(src[s], non_blocking=non_blocking)
