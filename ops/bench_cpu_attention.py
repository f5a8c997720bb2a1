"""Attention on the CPU: the fused C kernel against the batched PyTorch attention, alternated.

Decode: for each shape (running sequences x context tokens, heads/KV heads/head_dim) it times
`kernels.cpu_kernels.paged_attention` (``cpu``) and `kernels.reference.batched_paged_attention`
(``torch``) on the same scattered block tables, alternating the two ``--repeats`` times, and prints
the median CPU ms per call of the calling thread, the K/V bytes read per second, and the median of
the per-repeat ratios (torch / cpu). One thread (``torch.set_num_threads(1)``) unless ``--threads``.
Prefill: whole prompts (sequences x prompt tokens) through the C kernel (forced, whatever
``FUSED_MAX_QUERY_LEN``) against the batched path: where the crossover lies that sets that bound.
On a shared machine only the ratios mean much.

    python ops/bench_cpu_attention.py [--repeats 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedkv.kernels import cpu_kernels, reference

# (sequences, context, heads, kv heads, head_dim): stories260K, a Llama-3.2-1B-like layer, Llama-3.1-8B's
SHAPES = [(256, 112, 8, 4, 8), (64, 1024, 32, 8, 64), (16, 4096, 32, 8, 128)]
# prefill: whole prompts of `context` tokens; 19 x 108 is a stories260K prefill step of the conv trace
PREFILL = [(8, 128, 32, 8, 128), (1, 512, 32, 8, 128), (1, 1024, 32, 8, 64), (1, 2048, 32, 8, 128), (1, 2048, 8, 4, 8),
           (19, 108, 8, 4, 8)]


def inputs(num_seqs, context, num_heads, num_kv_heads, head_dim, block_size=16, prefill=False):
    gen = torch.Generator().manual_seed(0)
    num_blocks = num_seqs * -(-context // block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(num_seqs, -1)  # scattered blocks
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
    q_len = context if prefill else 1
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32) * q_len
    q = torch.randn(num_seqs * q_len, num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, seq_lens, qsl, head_dim ** -0.5


def cpu_ms(fn, args, iters):
    hints = {"max_query_len": int((args[5][1:] - args[5][:-1]).max()), "max_seq_len": int(args[4].max())}
    fn(*args, **hints)  # warm-up (and the kernel's build)
    start = time.thread_time()
    for _ in range(iters):
        fn(*args, **hints)
    return 1000 * (time.thread_time() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_kernels.fused_available(), "the C kernel did not build (is a C compiler installed?)"
    print(f"attention, CPU ms per call (thread time, {args.threads} thread(s)), median of {args.repeats} "
          "alternating repeats")
    print(f"{'seqs x ctx, heads/kv/dim':>28} {'cpu ms':>9} {'GB/s':>6} {'torch ms':>9} {'GB/s':>6} {'torch/cpu':>9}")
    cpu_kernels.FUSED_MAX_QUERY_LEN = 1 << 30  # the C kernel for every row, prefill included
    for prefill, shapes in ((False, SHAPES), (True, PREFILL)):
        if prefill:
            print("prefill (whole prompts; C forced for every length)")
        for num_seqs, context, heads, kv_heads, dim in shapes:
            measure(num_seqs, context, heads, kv_heads, dim, prefill, args.repeats)


def measure(num_seqs, context, heads, kv_heads, dim, prefill, repeats):
    """Print one row: C kernel and batched PyTorch, alternated ``repeats`` times."""
    batch = inputs(num_seqs, context, heads, kv_heads, dim, prefill=prefill)
    work = num_seqs * context * kv_heads * dim * (context // 2 if prefill else 1)
    iters = max(1, int(2e7 // work))
    times = {"cpu": [], "torch": []}
    for r in range(repeats):
        order = [("cpu", cpu_kernels.paged_attention), ("torch", reference.batched_paged_attention)]
        for name, fn in order if r % 2 == 0 else order[::-1]:
            times[name].append(cpu_ms(fn, batch, iters))
    kv_bytes = 2 * num_seqs * context * kv_heads * dim * 4
    c, t = statistics.median(times["cpu"]), statistics.median(times["torch"])
    ratio = statistics.median(b / a for a, b in zip(times["cpu"], times["torch"]))
    gbps = (lambda ms: f"{'-':>6}") if prefill else (lambda ms: f"{kv_bytes / ms / 1e6:6.2f}")  # K/V read once
    print(f"{f'{num_seqs} x {context}, {heads}/{kv_heads}/{dim}':>28} {c:9.2f} {gbps(c)} {t:9.2f} {gbps(t)} {ratio:8.1f}x")


if __name__ == "__main__":
    main()
