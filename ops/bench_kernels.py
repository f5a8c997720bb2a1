"""Benchmark the Triton paged-attention kernels on a GPU (decode and prefill/extend).

For each case of a batch × context × head-config grid (Llama 3.1 8B shapes among them: 32 query
heads, 8 KV heads, head_dim 128, block 16, bf16) it prints latency (CUDA events around each call,
L2 flushed before each, median of ``--iters`` after warmup), achieved memory bandwidth (K/V bytes
read plus q/out, in GB/s and % of the device's peak), and for prefill TFLOP/s, beside
``torch.nn.functional.scaled_dot_product_attention`` on contiguous K/V and beside FlashInfer's
paged wrappers when ``flashinfer`` is importable. The ``err`` column is the max |Triton - SDPA|
on the same inputs, a sanity check of the compiled kernels. Times include the Python wrapper's
launch overhead, as the engine sees it.

    python ops/bench_kernels.py [--quick] [--peak-gbps 4800] [--iters 30]

On a machine without a CUDA GPU it prints one line saying so and exits 0. A full run takes about
one to two minutes on an H100/H200 (mostly Triton compilation).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass

# Compiled kernels, never the interpreter, even if the caller's shell exported it.
os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# Peak HBM bandwidth in GB/s by device-name fragment, most specific first (vendor datasheets).
PEAK_GBPS = [
    ("GH200", 4000.0),  # before "H200", which its name contains
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # 40 GB
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
]


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" or "prefill" (prefill with ctx > q_len is an extend)
    batch: int
    q_len: int  # new tokens per sequence
    ctx: int  # context length per sequence, including the new tokens
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16

    @property
    def heads(self) -> str:
        return f"{self.num_heads}/{self.num_kv_heads}/{self.head_dim}"


LLAMA_DECODE = [(1, 1024), (1, 8192), (1, 32768), (8, 4096), (32, 4096), (64, 2048), (128, 2048),
                (256, 1024)]
LLAMA_PREFILL = [(1, 512, 512), (1, 2048, 2048), (1, 8192, 8192), (4, 2048, 2048),
                 (4, 256, 2304), (16, 512, 512)]


def build_cases(quick: bool) -> list[Case]:
    decode = LLAMA_DECODE[::2] if quick else LLAMA_DECODE
    prefill = LLAMA_PREFILL[::2] if quick else LLAMA_PREFILL
    cases = [Case("decode", b, 1, c) for b, c in decode]
    if not quick:
        cases += [
            Case("decode", 32, 1, 2048, num_heads=32, num_kv_heads=32),  # MHA (Llama 2 7B)
            Case("decode", 32, 1, 4096, num_heads=8, num_kv_heads=1, head_dim=256),  # MQA, d256
            Case("decode", 32, 1, 4096, block_size=128),
        ]
    cases += [Case("prefill", b, q, c) for b, q, c in prefill]
    return cases


def peak_gbps(name: str, override: float | None) -> float | None:
    if override:
        return override
    for fragment, gbps in PEAK_GBPS:
        if fragment in name:
            return gbps
    return None


def time_us(fn, iters: int, flush: torch.Tensor) -> float:
    """Median microseconds of ``fn()`` over ``iters`` calls, L2 flushed before each."""
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        flush.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device):
    """Paged caches with scattered block tables, plus the same K/V contiguous for SDPA."""
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = math.ceil(case.ctx / case.block_size)
    num_blocks = case.batch * blocks_per_seq
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_tables = perm.view(case.batch, blocks_per_seq)
    seq_lens = torch.full((case.batch,), case.ctx, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, (case.batch + 1) * case.q_len, case.q_len, dtype=torch.int32,
                                   device=device)
    q = torch.randn(case.batch * case.q_len, case.num_heads, case.head_dim, generator=gen,
                    device=device, dtype=dtype)

    def contiguous(cache):  # [batch, kv_heads, ctx, head_dim]
        rows = cache[block_tables.long()].flatten(1, 2)[:, :case.ctx]
        return rows.transpose(1, 2).contiguous()

    return q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, contiguous(k_cache), \
        contiguous(v_cache)


def sdpa_fn(case: Case, q, k, v, scale):
    """SDPA over contiguous K/V; causal with the new tokens at the end of the context."""
    qb = q.view(case.batch, case.q_len, case.num_heads, case.head_dim).transpose(1, 2)
    mask = None
    if case.q_len > 1 and case.q_len != case.ctx:
        q_pos = torch.arange(case.ctx - case.q_len, case.ctx, device=q.device)
        mask = torch.arange(case.ctx, device=q.device)[None, :] <= q_pos[:, None]
    causal = case.q_len > 1 and mask is None
    gqa = case.num_heads != case.num_kv_heads

    def run():
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                           enable_gqa=gqa)
        return o.transpose(1, 2).reshape(-1, case.num_heads, case.head_dim)

    return run


def flashinfer_fn(flashinfer, case: Case, q, k_cache, v_cache, block_tables, workspace):
    """FlashInfer's paged decode / prefill wrappers on the same NHD caches, planned once."""
    device = q.device
    blocks_per_seq = block_tables.shape[1]
    indptr = torch.arange(0, (case.batch + 1) * blocks_per_seq, blocks_per_seq, dtype=torch.int32,
                          device=device)
    indices = block_tables.reshape(-1).contiguous()
    last = case.ctx - (blocks_per_seq - 1) * case.block_size
    last_page_len = torch.full((case.batch,), last, dtype=torch.int32, device=device)
    if case.kind == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, last_page_len, case.num_heads, case.num_kv_heads,
                     case.head_dim, case.block_size, q_data_type=q.dtype, kv_data_type=q.dtype)
    else:
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        qo_indptr = torch.arange(0, (case.batch + 1) * case.q_len, case.q_len, dtype=torch.int32,
                                 device=device)
        wrapper.plan(qo_indptr, indptr, indices, last_page_len, case.num_heads, case.num_kv_heads,
                     case.head_dim, case.block_size, causal=True, q_data_type=q.dtype,
                     kv_data_type=q.dtype)
    return lambda: wrapper.run(q, (k_cache, v_cache))


def traffic(case: Case, dtype: torch.dtype) -> tuple[float, float]:
    """(bytes moved at least once, FLOPs) of one attention call."""
    elt = torch.finfo(dtype).bits // 8
    kv = 2 * case.batch * case.ctx * case.num_kv_heads * case.head_dim * elt
    qo = 2 * case.batch * case.q_len * case.num_heads * case.head_dim * elt
    prefix = case.ctx - case.q_len
    visible = case.q_len * prefix + case.q_len * (case.q_len + 1) / 2  # causal (query, key) pairs
    flops = 4 * case.batch * case.num_heads * case.head_dim * visible
    return kv + qo, flops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="half the grid")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per measurement")
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="device peak memory bandwidth, GB/s (default: from the device name)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--no-flashinfer", action="store_true")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA GPU is present; nothing to benchmark (this needs a GPU).")
        return 0

    from pagedkv.kernels import triton_kernels

    device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    name = torch.cuda.get_device_name(device)
    peak = peak_gbps(name, args.peak_gbps)
    flashinfer = None
    if not args.no_flashinfer:
        try:
            import flashinfer  # noqa: F401
        except Exception as exc:  # not installed, or built for another torch/CUDA
            print(f"flashinfer not importable ({type(exc).__name__}); skipping it")
            flashinfer = None
    workspace = (torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
                 if flashinfer else None)
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)  # > any L2

    print(f"device: {name}; peak {peak or '?'} GB/s; dtype {args.dtype}; median of {args.iters}; "
          f"triton {triton_kernels.__name__}")
    header = (f"{'kind':<8}{'batch':>6}{'q_len':>6}{'ctx':>7}{'heads':>11}{'bs':>5} |"
              f"{'triton us':>10}{'GB/s':>7}{'%peak':>6}{'TFLOP/s':>8} |{'sdpa us':>9}{'GB/s':>7} |"
              f"{'fi us':>8}{'GB/s':>7} |{'err':>9}")
    print(header)
    print("-" * len(header))
    for case in build_cases(args.quick):
        bytes_moved, flops = traffic(case, dtype)
        row = (f"{case.kind:<8}{case.batch:>6}{case.q_len:>6}{case.ctx:>7}{case.heads:>11}"
               f"{case.block_size:>5} |")
        try:
            q, k_cache, v_cache, bt, sl, qsl, k, v = make_inputs(case, dtype, device)
            scale = case.head_dim ** -0.5
            out = torch.empty_like(q)
            t_us = time_us(lambda: triton_kernels.paged_attention(q, k_cache, v_cache, bt, sl, qsl,
                                                                  scale, out), args.iters, flush)
            gbps = bytes_moved / t_us / 1e3
            pct = f"{100 * gbps / peak:.0f}" if peak else "?"
            row += f"{t_us:>10.1f}{gbps:>7.0f}{pct:>6}{flops / t_us / 1e6:>8.1f} |"
        except Exception as exc:
            print(row + f" triton failed: {type(exc).__name__}: {exc}"[:300])
            continue
        sdpa = sdpa_fn(case, q, k, v, scale)
        try:
            s_us = time_us(sdpa, args.iters, flush)
            err = (sdpa().float() - out.float()).abs().max().item()
            row += f"{s_us:>9.1f}{bytes_moved / s_us / 1e3:>7.0f} |"
        except Exception as exc:
            row += f"{type(exc).__name__[:16]:>16} |"
            err = float("nan")
        if flashinfer:
            try:
                fi = flashinfer_fn(flashinfer, case, q, k_cache, v_cache, bt, workspace)
                f_us = time_us(fi, args.iters, flush)
                row += f"{f_us:>8.1f}{bytes_moved / f_us / 1e3:>7.0f} |"
            except Exception as exc:
                row += f"{type(exc).__name__[:15]:>15} |"
        else:
            row += f"{'-':>8}{'-':>7} |"
        print(row + f"{err:>9.1e}", flush=True)
        del q, k_cache, v_cache, k, v, out
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
