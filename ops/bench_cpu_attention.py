"""Attention on the CPU: the fused C kernel against the batched PyTorch attention, alternated.

Decode: for each shape (running sequences x context tokens, heads/KV heads/head_dim) it times
`kernels.cpu_kernels.paged_attention` (``cpu``) and `kernels.reference.batched_paged_attention`
(``torch``) on the same scattered block tables, alternating the two ``--repeats`` times, and prints
the median CPU ms per call of the calling thread, the K/V bytes read per second, and the median of
the per-repeat ratios (torch / cpu). One thread (``torch.set_num_threads(1)``) unless ``--threads``.
Prefill: whole prompts (sequences x prompt tokens) through the C kernel (forced, whatever
``FUSED_MAX_QUERY_LEN``) against the batched path: where the crossover lies that sets that bound.
On a shared machine only the ratios mean much.

With ``--model PATH`` it also times the C kernel on a real model's attention inputs: every layer's
call in one prefill step of 25 prompts (the lengths of the Azure conv trace's first 25, scaled to
stories260K's 512-token context), captured from the model's forward, once with random token ids and
once with story text (through the model's tokenizer.json). Random Gaussian inputs understate what
real attention costs: a trained model's scores spread far wider, and the kernel's speed on those
depended on how it handles subnormal floats (`cpu_attention.c`'s flush_subnormals).

    python ops/bench_cpu_attention.py [--repeats 5] [--threads 1] [--model ../shared/models/stories260K]
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
# --model: the conv trace's first 25 prompt lengths at pagedkv bench's token scale for a 512-token context
CAPTURED_PROMPTS = [45, 48, 106, 11, 11, 46, 158, 47, 29, 25, 47, 47, 158, 267, 47, 50, 14, 44, 25, 163, 24, 22, 47,
                    491, 311]
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big red ball. She ran to the ball and kicked it. The ball went very high. Lily was happy. Her "
         "mom said, \"Lily, it is time to go home.\" They walked home together. The sun was shining and the birds "
         "were singing. Tom had a dog named Max. Max liked to run and jump. One day Max found a bone. ")


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
    return thread_ms(lambda: fn(*args, **hints), iters)


def thread_ms(run, iters: int) -> float:
    """CPU ms of the calling thread per call of ``run``, mean of ``iters`` after one warm-up call (the kernel's build)."""
    run()
    start = time.thread_time()
    for _ in range(iters):
        run()
    return 1000 * (time.thread_time() - start) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="alternations of the two paths per shape; timings of the captured inputs (default: 5)")
    p.add_argument("--threads", type=int, default=1, help="torch and C kernel threads (default: 1)")
    p.add_argument("--model", help="also time the kernel on this checkpoint's captured prefill inputs")
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
    if args.model:
        print(f"captured from {args.model}: one prefill step, {len(CAPTURED_PROMPTS)} prompts, "
              f"{sum(CAPTURED_PROMPTS)} tokens; C kernel CPU ms for all layers' calls, median of {args.repeats}")
        for kind, calls in captured_inputs(args.model).items():
            ms = statistics.median(thread_ms(lambda: [cpu_kernels.paged_attention(*a, **k) for a, k in calls], 10)
                                   for _ in range(args.repeats))
            print(f"{kind:>28} {ms:9.2f}")


def captured_inputs(model: str) -> dict[str, list]:
    """Each layer's paged_attention arguments in one prefill step of `CAPTURED_PROMPTS` on ``model``,
    per prompt kind ("random tokens", and "story text" where the checkpoint has a tokenizer.json)."""
    import os
    import random
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_worker_breakdown import prefill_runner, prefill_step

    runner, mc = prefill_runner(model, CAPTURED_PROMPTS)
    rng = random.Random(0)
    streams = {"random tokens": [rng.randrange(mc.vocab_size) for _ in range(2 * max(CAPTURED_PROMPTS))]}
    if os.path.exists(os.path.join(model, "tokenizer.json")):
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(os.path.join(model, "tokenizer.json")).encode(STORY * 8).ids
        streams["story text"] = ids if len(ids) >= 2 * max(CAPTURED_PROMPTS) else ids * 4
    calls: list = []
    fused = cpu_kernels.paged_attention

    def capture(*a, **k):
        calls.append(([x.clone() if isinstance(x, torch.Tensor) else x for x in a], k))
        return fused(*a, **k)

    captured = {}
    cpu_kernels.paged_attention = capture
    try:
        for step, (kind, ids) in enumerate(streams.items()):
            calls.clear()
            prefill_step(runner, step, [ids[7 * i:7 * i + n] for i, n in enumerate(CAPTURED_PROMPTS)])
            captured[kind] = list(calls)
    finally:
        cpu_kernels.paged_attention = fused
    return captured


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
