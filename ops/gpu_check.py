"""GPU checks of the worker hot path, for ops/gpu_check.sh (needs a CUDA GPU; never downloads anything).

``kernels``: the compiled Triton kernels against the per-sequence PyTorch oracle on CUDA in
bf16/fp16/fp32 (random mixed decode/prefill/extend batches, the decode-only hint, split-K at long
contexts), copy_blocks with a destination that is also a source, and a chunked prefill whose
inputs are staged while the GPU lags behind the host.

``anatomy``: Llama-3.1-8B shapes with dummy weights (bf16), decode steps at a batch x context grid
through `ModelRunner.execute`, eager and with CUDA graphs: wall ms per step, host ms (CPU time
of the thread, up to the sampler's device-to-host copy) and GPU busy % (CUDA events from the
first to the last kernel of the step, over wall).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402

ATOL = {torch.float32: 2e-3, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def check_kernels() -> bool:
    from pagedkv.kernels import reference, triton_kernels

    dev = torch.device("cuda")
    ok = True
    rng = random.Random(0)
    for trial in range(24):
        dtype = [torch.bfloat16, torch.float16, torch.float32][trial % 3]
        kv_heads = rng.choice([1, 2, 8])
        heads = kv_heads * rng.choice([1, 2, 4])
        head_dim = rng.choice([64, 128])
        bs = rng.choice([16, 32])
        q_lens, seq_lens = [], []
        for _ in range(rng.randint(1, 24)):
            q = rng.choice([1, 1, 1, rng.randint(2, 300)])
            q_lens.append(q)
            seq_lens.append(q + rng.choice([0, rng.randint(1, 6000)]))
        nblk = [-(-s // bs) for s in seq_lens]
        perm = torch.randperm(sum(nblk) + 3)
        tables = torch.zeros(len(seq_lens), max(nblk) + 4, dtype=torch.int32)
        used = 0
        for i, n in enumerate(nblk):
            tables[i, :n] = perm[used:used + n]
            used += n
        shape = (sum(nblk) + 3, bs, kv_heads, head_dim)
        k = torch.randn(shape, device=dev).to(dtype)
        v = torch.randn(shape, device=dev).to(dtype)
        q = torch.randn(sum(q_lens), heads, head_dim, device=dev).to(dtype)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        args = (q, k, v, tables.to(dev), torch.tensor(seq_lens, dtype=torch.int32, device=dev), qsl, head_dim ** -0.5)
        want = reference.paged_attention(*args).float()
        hint = dict(max_query_len=max(q_lens), max_seq_len=max(seq_lens))
        t0 = time.perf_counter()
        errs = []
        for name, got in (("no hint", triton_kernels.paged_attention(*args)),
                          ("hint", triton_kernels.paged_attention(*args, **hint)),
                          ("batched torch", reference.batched_paged_attention(*args))):
            err = (got.float() - want).abs().max().item()
            good = err <= ATOL[dtype]
            ok &= good
            errs.append(f"{name} {err:.1e}{'' if good else ' FAIL'}")
        # one line per trial, flushed: a run cut short by its timeout still shows how far it got
        # (the first trial of each dtype/head_dim/block_size pays Triton's compile)
        print(f"  trial {trial:2d} {str(dtype)[6:]:8s} heads {heads}/{kv_heads} d {head_dim} bs {bs} "
              f"{len(q_lens)} seqs, max ctx {max(seq_lens)}: {', '.join(errs)} ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    # copy_blocks: a chain and a cycle, destination also a source, mapping on host and on device
    for on_device in (False, True):
        kc = [torch.randn(10, 16, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        vc = [torch.randn_like(t) for t in kc]
        ek, ev = [t.clone() for t in kc], [t.clone() for t in vc]
        mapping = torch.tensor([[1, 2], [2, 3], [5, 6], [6, 5], [0, 9]])
        reference.copy_blocks(ek, ev, mapping)
        triton_kernels.copy_blocks(kc, vc, mapping.to(dev) if on_device else mapping)
        good = all(torch.equal(a, b) for a, b in zip(kc + vc, ek + ev))
        ok &= good
        if not good:
            print(f"  FAIL copy_blocks aliasing (mapping on {'device' if on_device else 'host'})")
    ok &= check_staging()
    print(f"kernels vs oracle on CUDA: {'OK' if ok else 'FAILED'}")
    return ok


def check_staging(device: str = "cuda") -> bool:
    """A prompt prefilled in chunks that sample nothing, queued behind a busy GPU so the host runs ahead,
    gives the same top logprobs as the prompt in one step: `ModelRunner._stage` must not rewrite its
    pinned buffer before the previous step's copy has read it (the embedded model, float32)."""
    from pagedkv.common.config import EngineConfig, ModelConfig
    from pagedkv.common.protocol import CachedRequestData, NewRequestData, StepPlan
    from pagedkv.common.sampling_params import SamplingParams
    from pagedkv.worker.model_runner import ModelRunner

    dev = torch.device(device)
    runner = ModelRunner(EngineConfig(enforce_eager=True), dev, torch.float32, ModelConfig.load(None))
    runner.init_cache(64, 0)
    n, chunk = 256, 16
    prompt = [(7 * j + 3) % 200 + 10 for j in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    blocks = list(range(-(-n // runner.block_size)))  # all in the first plan: later steps write no block-table entry

    def whole_or_chunks(rid: str, first: int, step: int) -> tuple:
        result = runner.execute(StepPlan(step, new_requests=[NewRequestData(rid, prompt, n, blocks, 0, first, params)]))
        if dev.type == "cuda" and first < n:
            torch.cuda.synchronize()
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work queued ahead of the chunks' copies
        for _ in range(first, n, chunk):
            result = runner.execute(StepPlan(step := step + 1, cached_requests=[CachedRequestData(rid, [], chunk)]))
        runner.execute(StepPlan(step + 1, finished_request_ids=[rid]))
        (tok,) = result.sampled
        return tok.token_id, tok.top_logprobs

    want = whole_or_chunks("whole", n, 0)
    got = whole_or_chunks("chunked", chunk, 10)
    good = got[0] == want[0] and all(a[0] == b[0] and abs(a[1] - b[1]) < 1e-3 for a, b in zip(got[1], want[1]))
    print(f"  staged inputs, {n // chunk} prefill chunks queued behind a busy GPU: "
          f"{'OK' if good else f'FAIL {got} != {want}'}", flush=True)
    return good


def anatomy(config_dir: str, grid: list[tuple[int, int]], steps: int) -> list[dict]:
    from pagedkv.common.config import EngineConfig, ModelConfig
    from pagedkv.common.protocol import CachedRequestData, NewRequestData, StepPlan
    from pagedkv.common.sampling_params import SamplingParams
    from pagedkv.worker.model_runner import ModelRunner

    dev = torch.device("cuda")
    max_ctx = max(c for _, c in grid) + steps + 32
    max_seqs = max(b for b, _ in grid)
    cfg = EngineConfig(model=config_dir, load_format="dummy", max_num_seqs=max_seqs, max_model_len=max_ctx,
                       enforce_eager=True)
    t0 = time.perf_counter()
    runner = ModelRunner(cfg, dev, torch.bfloat16, ModelConfig.load(config_dir))
    print(f"  model built (dummy weights): {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    runner.warm_up()
    print(f"  kernels warmed up: {time.perf_counter() - t0:.1f} s", flush=True)
    runner.init_cache(max(b * -(-(c + steps + 1) // 16) for b, c in grid) + 8, 0)  # one grid point at a time
    rows = []
    greedy = SamplingParams(temperature=0.0, max_tokens=steps + 4)
    for graphs in (False, True):
        runner.graphs = None
        if graphs:
            t0 = time.perf_counter()
            runner.init_decode_graphs()
            print(f"  decode graphs captured: {time.perf_counter() - t0:.1f} s", flush=True)
        for batch, ctx in grid:
            nb = -(-(ctx + steps + 1) // 16)
            news = [NewRequestData(f"r{i}", [(i + j) % 1000 for j in range(ctx)], ctx,
                                   list(range(i * nb, (i + 1) * nb)), ctx - 1, 1, greedy) for i in range(batch)]
            runner.execute(StepPlan(0, new_requests=news))
            walls, hosts, busy = [], [], []
            for s in range(1, steps + 1):
                plan = StepPlan(s, cached_requests=[CachedRequestData(f"r{i}", [], 1) for i in range(batch)])
                torch.cuda.synchronize()
                start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                w0, h0 = time.perf_counter(), time.thread_time()
                start_ev.record()
                result = runner.execute(plan)  # ends with the sampled tokens' copy to the host
                end_ev.record()
                h1 = time.thread_time()
                torch.cuda.synchronize()
                w1 = time.perf_counter()
                assert result.error is None and len(result.sampled) == batch
                if s > 3:
                    walls.append(1000 * (w1 - w0))
                    hosts.append(1000 * (h1 - h0))
                    busy.append(start_ev.elapsed_time(end_ev) / (1000 * (w1 - w0)))
            runner.execute(StepPlan(steps + 1, finished_request_ids=[f"r{i}" for i in range(batch)]))
            row = {"graphs": graphs, "batch": batch, "context": ctx, "wall_ms": statistics.median(walls),
                   "host_cpu_ms": statistics.median(hosts), "gpu_span_over_wall": statistics.median(busy)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("what", choices=["kernels", "anatomy"])
    p.add_argument("--model-config", default=str(Path(__file__).resolve().parents[2] / "shared/model-configs/llama-3.1-8b"))
    p.add_argument("--grid", default="1x1024,16x1024,64x1024,256x1024,64x8192")
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing checked")
        return
    if args.what == "kernels":
        sys.exit(0 if check_kernels() else 1)
    grid = [tuple(int(x) for x in g.split("x")) for g in args.grid.split(",")]
    anatomy(args.model_config, grid, args.steps)


if __name__ == "__main__":
    main()
