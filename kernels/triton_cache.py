"""KV-cache writes and block copies in Triton.

Same signatures and semantics as `kernels.reference.write_kv_cache` and
`kernels.reference.copy_blocks` (layout ``[num_blocks, block_size, num_kv_heads, head_dim]``,
slot = block_id * block_size + offset; PagedAttention, Kwon et al. 2023, section 4.1 and 4.4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels import fp8

# fp8 blocks are copied as bytes: a copy needs only the element size (and works on any GPU)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
              torch.float8_e4m3fn: tl.uint8, torch.float8_e5m2: tl.uint8}
_COPY_CHUNK = 2048  # elements per copy program: ~4-8 KiB, enough bytes in flight per SM


@triton.jit
def _fp8_grid(x, scale, FP8_MAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """``x / scale`` saturated and rounded to nearest even on the fp8 grid, still in fp32.

    The value is then exactly representable, so the store's cast has nothing left to round (the
    interpreter's fp32 -> fp8 cast drops the carry when rounding crosses a power of two). The grid
    step is 2^(e - MANT) for a value in [2^e, 2^(e+1)), e >= EMIN (subnormals below), built from
    the exponent bits: exact, unlike log2/exp2 approximations.
    """
    y = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    step = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    r = (a / step + 12582912.0) - 12582912.0  # 1.5 x 2^23: fp32 addition rounds to an integer, ties to even
    return tl.where(y < 0, -r * step, r * step)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale, v_scale,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch, stride_kcd,
    stride_vcb, stride_vct, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr, FP8_EMIN: tl.constexpr,
):
    """One program: all KV heads of one token. FP8_MAX > 0: quantize into an fp8 cache."""
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # padding token
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)
    k = tl.load(key_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh
                + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh
                + offs_d[None, :] * stride_vd, mask=mask)
    if FP8_MAX > 0:  # x / scale, saturated (fp8 e4m3 has no infinity), rounded to nearest even
        k = _fp8_grid(k, k_scale, FP8_MAX, FP8_MANT, FP8_EMIN)
        v = _fp8_grid(v, v_scale, FP8_MAX, FP8_MANT, FP8_EMIN)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch
             + offs_d[None, :] * stride_kcd, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch
             + offs_d[None, :] * stride_vcd, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store new tokens' K and V into their slots, in place (Triton).

    key, value: ``[num_tokens, num_kv_heads, head_dim]``, any strides (e.g. views of a fused QKV
    projection); k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    slot_mapping: ``[num_tokens]`` int64 (int32 accepted), slot = block_id * block_size + offset,
    -1 = skip (padding). Values are cast to the cache dtype (round to nearest even on GPU); into an
    fp8 cache they are quantized, ``x / k_scale`` (``x / v_scale``) saturated (`kernels.fp8`).
    Slots must be distinct. Raises ValueError on inconsistent shapes or devices.
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim]; "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
                         f"head_dim]; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key heads/head_dim {tuple(key.shape[1:])} != cache "
                         f"{tuple(k_cache.shape[2:])}")
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}] int64, got "
                         f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    for name, t in (("value", value), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slot_mapping", slot_mapping)):
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1], num_warps=4, **_fp8_format(k_cache.dtype))


def _fp8_format(dtype: torch.dtype) -> dict:
    """The write kernel's fp8 constants: largest finite value, mantissa bits, smallest normal exponent."""
    if not fp8.is_fp8(dtype):
        return {"FP8_MAX": 0.0, "FP8_MANT": 0, "FP8_EMIN": 0}
    info = torch.finfo(dtype)
    return {"FP8_MAX": info.max, "FP8_MANT": {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[dtype],
            "FP8_EMIN": int(torch.log2(torch.tensor(info.tiny)).item())}


@triton.jit
def _copy_blocks_kernel(src_ptrs, dst_ptrs, block_mapping_ptr, src_block_stride, dst_block_stride,
                        BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr, DTYPE: tl.constexpr):
    """One program: one chunk of one (src, dst) pair of one cache (a layer's K or V)."""
    src_cache = tl.load(src_ptrs + tl.program_id(0)).to(tl.pointer_type(DTYPE))
    dst_cache = tl.load(dst_ptrs + tl.program_id(0)).to(tl.pointer_type(DTYPE))
    pair = tl.program_id(1)
    src = tl.load(block_mapping_ptr + 2 * pair)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(src_cache + src * src_block_stride + offs, mask=mask)
    tl.store(dst_cache + dst * dst_block_stride + offs, x, mask=mask)


def copy_blocks(
    k_caches: list[torch.Tensor],
    v_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """Copy whole blocks within each layer's caches, in place (copy-on-write).

    k_caches, v_caches: one ``[num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer,
    all of one shape, dtype, device and strides, each block's contents contiguous.
    block_mapping: ``[n, 2]`` int64 of (src, dst) physical block ids (moved to the caches' device
    if needed); dst blocks are distinct. Every copy reads its source as it was before the call,
    as the reference's gather-then-scatter does, even when a destination is also a source: then
    the sources are first gathered into a temporary (two launches), else one launch copies in place.
    A mapping already on the GPU is treated as possibly aliased (checking would sync).
    Raises ValueError on inconsistent caches or a malformed mapping.
    """
    if len(k_caches) != len(v_caches) or not k_caches:
        raise ValueError(f"need one k and one v cache per layer, got {len(k_caches)} and "
                         f"{len(v_caches)}")
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [n, 2], got {tuple(block_mapping.shape)}")
    if block_mapping.numel() == 0:
        return
    first = k_caches[0]
    caches = list(k_caches) + list(v_caches)
    for t in caches:
        if (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device
                or t.stride() != first.stride()):
            raise ValueError("all caches must share shape, dtype, device and strides; got "
                             f"{tuple(t.shape)} {t.dtype} {t.device} {t.stride()} vs "
                             f"{tuple(first.shape)} {first.dtype} {first.device} {first.stride()}")
    if first.dim() != 4 or not first[0].is_contiguous():
        raise ValueError("caches must be [num_blocks, block_size, num_kv_heads, head_dim] with "
                         "each block contiguous")
    if first.dtype not in _TL_DTYPES:
        raise ValueError(f"cache dtype {first.dtype} is not one of fp32, fp16, bf16, fp8 (e4m3, e5m2)")
    device = first.device
    if block_mapping.device.type == "cpu":
        aliased = bool(torch.isin(block_mapping[:, 1], block_mapping[:, 0]).any())
    else:
        aliased = True
    mapping = block_mapping.to(device=device, dtype=torch.int64).contiguous()
    # Per-cache base addresses: one launch covers every layer's K and V.
    cache_ptrs = torch.tensor([t.data_ptr() for t in caches], dtype=torch.int64, device=device)
    block_numel, n = first[0].numel(), mapping.shape[0]
    grid = (len(caches), n, triton.cdiv(block_numel, _COPY_CHUNK))
    meta = dict(BLOCK_NUMEL=block_numel, CHUNK=_COPY_CHUNK, DTYPE=_TL_DTYPES[first.dtype], num_warps=4)
    if not aliased:
        _copy_blocks_kernel[grid](cache_ptrs, cache_ptrs, mapping, first.stride(0), first.stride(0), **meta)
        return
    tmp = torch.empty(len(caches), n, block_numel, dtype=first.dtype, device=device)
    tmp_ptrs = torch.tensor([t.data_ptr() for t in tmp], dtype=torch.int64, device=device)
    slots = torch.arange(n, device=device)
    _copy_blocks_kernel[grid](cache_ptrs, tmp_ptrs, torch.stack([mapping[:, 0], slots], 1).contiguous(),
                              first.stride(0), block_numel, **meta)
    _copy_blocks_kernel[grid](tmp_ptrs, cache_ptrs, torch.stack([slots, mapping[:, 1]], 1).contiguous(),
                              block_numel, first.stride(0), **meta)
