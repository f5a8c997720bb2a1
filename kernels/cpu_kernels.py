"""The CPU backend: fused C attention, C RMSNorm / RoPE / KV write, batched PyTorch for long prefills.

Decode is bound by reading the KV cache, so decode rows (one new token) go to
``cpu_attention.c``, which reads each sequence's K/V in place through its block table. So do
extend and prefill rows of sequences with at most ``FUSED_MAX_QUERY_LEN`` new tokens, in tiles of
up to 16 consecutive tokens that share each K/V read (an online softmax, FlashAttention-style): no
padding and no mask, each token stops at its own position. Longer prefill chunks stay on
`reference.batched_paged_attention`'s gather + batched GEMMs (`ops/bench_cpu_attention.py` times
both; with the tiles, C is also the faster at 2,048 tokens, 2.4-2.7x at head_dim 128).
``cpu_ops.c`` holds a layer's small per-token operations (`rms_norm`, `rotary_embedding`,
`write_kv_cache`, `silu_and_mul`): a few microseconds of arithmetic each, behind tens of microseconds
of PyTorch per-op overhead on a small model; RoPE and the KV write are bit-identical to the reference's.
RMSNorm, RoPE and the KV write also take bfloat16 activations: there PyTorch's RMSNorm and RoPE
were each a tenth of a bfloat16 prefill step of a ~200M model on a CPU with AMX, where the
projections' GEMMs are fast; each op rounds to bfloat16 where PyTorch's would.

The C files are compiled on first use with the system C compiler (``$CC``, else ``cc``) into
``$PAGEDKV_CACHE_DIR`` (default ``~/.cache/pagedkv``), keyed by a hash of the source, flags and CPU,
and loaded with ctypes: about a second each, once per machine. Without a compiler, or for a pool
whose element type the kernels do not handle (float16), or for tensors neither float32 nor bfloat16, or off the CPU,
the reference's PyTorch code runs instead: same results, slower; `fused_available` says which, and
the worker logs it at start. Same signatures as `kernels.reference`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from pagedkv.kernels import reference
from pagedkv.kernels.reference import copy_blocks, swap_blocks

log = logging.getLogger("pagedkv.kernels")

__all__ = ["paged_attention", "write_kv_cache", "copy_blocks", "swap_blocks", "rms_norm", "rotary_embedding",
           "silu_and_mul", "fused_available"]

# -O3 vectorizes the per-element loops; -march=native uses this CPU's vector width, so a build is
# keyed by the CPU (below). For the attention, -ffast-math's parts let the compiler reassociate the
# dot products and fuse multiply-adds (results differ from the oracle by float rounding only, tested
# to 1e-5); not the flag itself, which links crtfastmath.o: loading the library switched on
# flush-to-zero in the loading thread for good, PyTorch's float32 included. The kernel flushes
# subnormals itself, only while it runs (cpu_attention.c's flush_subnormals). cpu_ops.c is built
# without them, and without contraction into fused multiply-adds (Clang's default), so that its
# results round as PyTorch's do.
# On x86 the attention's loops that the compiler vectorizes itself stay at 256 bits (its explicit
# 512-bit vectors are untouched): where GCC's tuning prefers 512 (on an AMD EPYC that gcc 12 tunes as
# znver3), wider vectors reassociated sums, so the AVX-512 build's bits differed from the build
# without it, and were no faster (256 x 100, 3 alternations: 24-38 ns a key at 512 bits, 20-36 at 256).
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11", "-pthread"]
_SOURCE_FLAGS = {"cpu_attention.c": ["-fassociative-math", "-freciprocal-math", "-fno-signed-zeros",
                                     "-fno-trapping-math", "-ffinite-math-only", "-fno-math-errno",
                                     "-ffp-contract=fast"],
                 "cpu_ops.c": ["-fno-math-errno", "-ffp-contract=off"]}  # -fno-math-errno: sqrtf inline
_X86_FLAGS = {"cpu_attention.c": ["-mprefer-vector-width=256"]}  # options GCC has only for x86
# Sequences with up to this many new tokens run in C (the tiles beat the batched GEMMs at 2,048 on
# every shape of ops/bench_cpu_attention.py: 2.4-15x); longer prefill chunks in batched GEMMs.
# 2,048 is the default max_num_batched_tokens, so by default every prefill chunk runs in C.
FUSED_MAX_QUERY_LEN = 2048
# the kernel's element kinds (cpu_attention.c's KV_F32, KV_BF16, KV_LUT8): 8-bit pools decode through a table
_F32, _BF16, _LUT8 = 0, 1, 2
_KINDS = {torch.float32: _F32, torch.bfloat16: _BF16, torch.float8_e4m3fn: _LUT8, torch.float8_e5m2: _LUT8}


@cache
def _library(source_name: str = "cpu_attention.c") -> ctypes.CDLL | None:
    """The compiled ``source_name``, built on first use; None (logged once) when no C compiler could build it."""
    path = Path(__file__).with_name(source_name)
    try:  # the key covers the headers it may include (cpu_vector.h) as well as the file itself
        source = path.read_bytes() + b"".join(h.read_bytes() for h in sorted(path.parent.glob("*.h")))
    except OSError as e:  # an installation without the C sources: the reference's PyTorch code runs
        log.warning("cannot read %s: %s", source_name, e)
        return None
    cc = os.environ.get("CC", "cc")
    flags = _FLAGS + _SOURCE_FLAGS[source_name]
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        flags += _X86_FLAGS.get(source_name, [])
    key = hashlib.sha256(source + " ".join([cc, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    cache_dir = Path(os.environ.get("PAGEDKV_CACHE_DIR", Path.home() / ".cache" / "pagedkv"))
    so = cache_dir / f"{path.stem}-{key}.so"
    if not so.exists():
        tmp = None
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            # build beside the target, then rename: workers starting together never load half a file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
            os.close(fd)
            subprocess.run([cc, *flags, str(path), "-o", tmp, "-lm"], check=True, capture_output=True,
                           text=True, timeout=120)
            os.replace(tmp, so)
        except (OSError, subprocess.SubprocessError) as e:
            detail = e.stderr.strip().splitlines()[-1:] if isinstance(e, subprocess.CalledProcessError) else [str(e)]
            log.warning("cannot build %s with %r: %s", source_name, cc, " ".join(detail))
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return None
    lib = ctypes.CDLL(str(so))
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {  # name: (argument types, result type)
        "paged_attention_fused": ([p, p, p, i32, p, p, i64, p, p, i64, i32, i32, i32, i32, i32, i64, i64, f32, f32, f32,
                                   p, i32], i32),
        "rms_norm": ([i32, p, i64, p, f32, i64, i32, p, i64], None),
        "rotary_embedding": ([i32, p, i64, i32, p, i64, i32, i32, p, p, i64], None),
        "write_kv_cache": ([p, i64, p, i64, p, p, i32, i32, p, i64, i32, i64], i32),
        "silu_and_mul": ([p, i64, i64, i32, p, i64], None),
    }
    for name, (argtypes, restype) in signatures.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    return lib


def _cpu_id() -> str:
    """The machine and its CPU's model and feature flags: a library built for one CPU is not loaded on another."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))][:2]
    return platform.machine() + "|".join(lines)


@cache
def _lut(dtype: torch.dtype) -> torch.Tensor:
    """float32 ``[256]``: the value of each 8-bit pattern of ``dtype`` (fp8 decode table)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def fused_available(kv_cache_dtype: torch.dtype = torch.float32) -> bool:
    """Whether a CPU pool of ``kv_cache_dtype`` runs the fused C kernel here (else the batched path)."""
    return kv_cache_dtype in _KINDS and _library() is not None


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
    """`reference.paged_attention` (same arguments, layouts and result), fused in C where it pays.

    Rows of sequences with 1 to ``FUSED_MAX_QUERY_LEN`` new tokens in a CPU float32, bfloat16 or
    fp8 pool run `cpu_attention.c`; longer prefill chunks, and every row where `fused_available`
    is False or where V's pool differs from K's (layout, element type, shape) or the shapes disagree,
    run `reference.batched_paged_attention`. max_query_len <= ``FUSED_MAX_QUERY_LEN``
    (e.g. a decode-only step) skips the batched pass; max_query_len and max_seq_len, when given,
    must bound the batch's (else they are computed here). The fused rows are split over
    ``torch.get_num_threads()`` threads (tiles of new tokens, by (query, key) pairs, at least about 4K of
    them per thread). Raises MemoryError when the kernel cannot allocate its scratch (``num_heads x
    max_seq_len`` floats per thread, and a tile's), IndexError
    when a fused row's block table holds a block id outside ``[0, num_blocks)`` within its length
    (nothing is read outside the pool).
    """
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    _, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    # the kernel reads V with K's layout, element type and pool size, and trusts the shapes: other
    # cases take the batched path (and its errors), which never reads past a tensor
    if (q.device.type != "cpu" or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape or not fused_available(k_cache.dtype)
            or k_cache.shape[3] != head_dim or num_heads % num_kv_heads
            or block_tables.shape[0] < seq_lens.shape[0] or query_start_loc.shape[0] < seq_lens.shape[0] + 1):
        return reference.batched_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                                 scale, out, max_query_len, max_seq_len, k_scale, v_scale)
    q32 = q.float().contiguous()
    out32 = out if out.dtype == torch.float32 and out.is_contiguous() else torch.empty_like(q32)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    max_len = int(max_seq_len) if max_seq_len is not None else int(lens.max())
    kind = _KINDS[k_cache.dtype]
    lut = _lut(k_cache.dtype) if kind == _LUT8 else None
    rc = _library().paged_attention_fused(
        q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kind,
        None if lut is None else lut.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        starts.data_ptr(), lens.shape[0], num_heads, num_kv_heads, head_dim, block_size, FUSED_MAX_QUERY_LEN,
        k_cache.shape[0], max_len, scale, k_scale, v_scale, out32.data_ptr(), torch.get_num_threads())
    if rc == -2:
        raise IndexError(f"a block table names a block outside the pool's {k_cache.shape[0]} within its sequence")
    if rc != 0:
        raise MemoryError(f"fused paged attention: no memory for {num_heads} x {max_len} scores")
    if max_query_len is None:
        max_query_len = int((starts[1:] - starts[:-1]).max())
    if max_query_len > FUSED_MAX_QUERY_LEN:  # longer prefill rows
        reference.batched_paged_attention(q32, k_cache, v_cache, tables, lens, starts, scale, out32,
                                          k_scale=k_scale, v_scale=v_scale, fused_max_query_len=FUSED_MAX_QUERY_LEN)
    if out32 is not out:  # rows past the last sequence's are the caller's: out32 holds garbage there
        rows = int(starts[-1])
        out[:rows].copy_(out32[:rows])
    return out


def _rows(x: torch.Tensor) -> bool:
    """Whether x (``[num_tokens, ...]``, float32 or bfloat16, on the CPU, not empty) has each token's row
    contiguous, whatever the stride between rows (a slice of a wider tensor qualifies): what cpu_ops.c
    reads. Plain stride arithmetic: this runs several times per layer per step."""
    shape, strides = x.shape, x.stride()
    if (x.dtype is not torch.float32 and x.dtype is not torch.bfloat16) or not x.is_cpu or len(shape) < 2 \
            or shape[0] == 0:
        return False
    row = 1
    for size, stride in zip(reversed(shape[1:]), reversed(strides[1:])):
        if stride != row and size != 1:
            return False
        row *= size
    return strides[0] >= row


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.rms_norm` (same arguments and result), in C for float32 and bfloat16 on the CPU.

    x: ``[num_tokens, hidden_size]``, rows contiguous (a slice qualifies); weight ``[hidden_size]`` of
    x's dtype (another dtype takes the reference, which promotes). The sum of squares is taken in
    another order than PyTorch's: results differ by float rounding (for bfloat16, rarely, by up to
    two units in the last place).
    """
    lib = _library("cpu_ops.c")
    if (lib is None or x.dim() != 2 or not _rows(x) or weight.dtype != x.dtype or not weight.is_contiguous()
            or weight.shape != x.shape[1:]):
        return reference.rms_norm(x, weight, eps)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    lib.rms_norm(_KINDS[x.dtype], x.data_ptr(), x.stride(0), weight.data_ptr(), eps, x.shape[0], x.shape[1],
                 out.data_ptr(), out.stride(0))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`reference.silu_and_mul` (same argument and result), in C for float32 on the CPU: one pass over x.

    x: ``[num_tokens, 2 * intermediate_size]``, rows contiguous. Its e^x is a polynomial: results
    differ from PyTorch's silu by float rounding. bfloat16 takes the reference (see cpu_ops.c).
    """
    lib = _library("cpu_ops.c")
    if lib is None or x.dim() != 2 or x.dtype != torch.float32 or not _rows(x) or x.shape[1] % 2:
        return reference.silu_and_mul(x)
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    lib.silu_and_mul(x.data_ptr(), x.stride(0), x.shape[0], out.shape[1], out.data_ptr(), out.stride(0))
    return out


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rotary_embedding`, bit-identical but for NaN's bits, in C for float32 and bfloat16 on the
    CPU: q and k are rotated IN PLACE and returned.

    q: ``[num_tokens, num_heads, head_dim]``, k: ``[num_tokens, num_kv_heads, head_dim]`` of q's dtype,
    each token's row contiguous (slices of one fused QKV output qualify); cos, sin: float32
    ``[num_tokens, head_dim // 2]``. Other cases (float16, q and k of different dtypes, an odd
    head_dim) take the reference, and its new tensors or its errors.
    """
    lib = _library("cpu_ops.c")
    if (lib is None or not (_rows(q) and _rows(k)) or k.dtype != q.dtype or q.shape[2] % 2
            or not (cos.is_contiguous() and sin.is_contiguous())
            or cos.dtype != torch.float32 or sin.dtype != torch.float32 or cos.shape != sin.shape
            or cos.shape != (q.shape[0], q.shape[2] // 2) or k.shape[::2] != q.shape[::2]):
        return reference.rotary_embedding(q, k, cos, sin)
    lib.rotary_embedding(_KINDS[q.dtype], q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
                         q.shape[2], cos.data_ptr(), sin.data_ptr(), q.shape[0])
    return q, k


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """`reference.write_kv_cache` (same arguments, bit-identical but for NaN's bits), in C for float32 or
    bfloat16 K/V (both of one dtype) into a float32 or bfloat16 CPU pool; fp8 pools (quantized with
    the scales), K and V of different dtypes, and V pools of another shape than K's take the reference.

    key, value: ``[num_tokens, num_kv_heads, head_dim]``, each token's row contiguous; slot_mapping
    ``[num_tokens]`` int64, -1 = skip. Raises IndexError, writing nothing, for a slot outside the pool.
    """
    lib = _library("cpu_ops.c")
    if (lib is None or k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype
            or not (_rows(key) and _rows(value)) or value.dtype != key.dtype or not k_cache.is_cpu
            or key.shape[1:] != k_cache.shape[2:] or v_cache.shape != k_cache.shape
            or value.shape != key.shape or slot_mapping.shape != key.shape[:1]
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.write_kv_cache(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache.data_ptr(),
                            v_cache.data_ptr(), _KINDS[key.dtype], _KINDS[k_cache.dtype], slots.data_ptr(),
                            key.shape[0], k_cache.shape[2] * k_cache.shape[3], num_slots)
    if rc != 0:
        raise IndexError(f"slot_mapping names a slot outside the pool's {num_slots}")
