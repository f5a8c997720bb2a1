"""GPU checks of the worker hot path, for ops/gpu_check.sh (needs a CUDA GPU; never downloads anything).

``kernels``: the compiled Triton kernels against the per-sequence PyTorch oracle on CUDA in
bf16/fp16/fp32 (random mixed decode/prefill/extend batches, the decode-only hint, split-K at long
contexts), copy_blocks with a destination that is also a source, a chunked prefill whose
inputs are staged while the GPU lags behind the host, decode steps replayed from captured CUDA graphs
against eager ones, the device block table against the host's through random row moves, growth and
repeated writes, and the memory profile's peak against a served prompt-logprobs step's.

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
    for check in (check_staging, check_graphs, check_block_table, check_profile):
        ok &= check()
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


def check_graphs(device: str = "cuda") -> bool:
    """Decode steps replayed from captured CUDA graphs (padded batch sizes: slot -1, seq_len 0 rows) give the
    eager forward's tokens and logprobs, while requests join (a mixed step, eager) and leave (the batch
    shrinks to another padded size). The embedded model, float32; on the CPU the same padded static-buffer
    path runs eagerly (capture=False)."""
    from pagedkv.common.config import EngineConfig, ModelConfig
    from pagedkv.common.protocol import CachedRequestData, NewRequestData, StepPlan
    from pagedkv.common.sampling_params import SamplingParams
    from pagedkv.worker.model_runner import ModelRunner

    dev = torch.device(device)
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=3)
    prompts = {f"r{i}": [(11 * i + 5 * j) % 250 + 1 for j in range(9 + 7 * i)] for i in range(5)}
    first_block = {"r0": 0, "r1": 8, "r2": 16, "r3": 24, "r4": 24}  # r4 takes the blocks r3 left
    results, replays = [], []
    for graphs in (False, True):
        runner = ModelRunner(EngineConfig(enforce_eager=True, max_num_seqs=8), dev, torch.float32, ModelConfig.load(None))
        runner.init_cache(4 * 8, 0)
        if graphs:
            runner.init_decode_graphs(capture=dev.type == "cuda")
            run = runner.graphs.run
            runner.graphs.run = lambda *a: replays.append(a[0].shape[0]) or run(*a)
        out = []

        def new(i: int) -> NewRequestData:
            rid = f"r{i}"
            blocks = list(range(first_block[rid], first_block[rid] + 8))
            return NewRequestData(rid, prompts[rid], len(prompts[rid]), blocks, 0, len(prompts[rid]), params)

        live = ["r0", "r1", "r2"]
        plan = StepPlan(0, new_requests=[new(0), new(1), new(2)])
        for step in range(1, 12):
            result = runner.execute(plan)
            out += [(step, t.request_id, t.token_id, t.logprob) for t in result.sampled]
            news, gone = [], []
            if step == 3:  # r3 joins: a mixed step (its prefill beside three decodes), eager
                news, live = [new(3)], live + ["r3"]
            if step == 6:  # r0 and r3 leave: 2 rows, then r4 joins: 3 rows, padded to 4
                gone, live = ["r0", "r3"], ["r1", "r2"]
            if step == 8:  # a padding row's last slot (r3's, at 4 rows) now lies in r4's prompt
                news, live = [new(4)], live + ["r4"]
            cached = [CachedRequestData(r, [], 1) for r in live if not any(n.request_id == r for n in news)]
            plan = StepPlan(step, new_requests=news, cached_requests=cached, finished_request_ids=gone)
        results.append(out)
    eager, graphed = results
    good = len(eager) == len(graphed) and len(replays) >= 5 and all(
        a[:3] == b[:3] and abs(a[3] - b[3]) < 1e-3 for a, b in zip(eager, graphed))
    print(f"  decode graphs ({len(replays)} replays at {sorted(set(replays))} rows) against eager steps: "
          f"{'OK' if good else 'FAIL'}", flush=True)
    if not good:
        print(f"    eager   {eager}\n    graphed {graphed}", flush=True)
    return good


def check_block_table(device: str = "cuda") -> bool:
    """The device block table equals the host's after each flush, through random adds, removes (the last row
    moves), appends, copy-on-write replacements of a column already pending, and growth of the rows mid-step.
    On the CPU the device table is emulated apart from the host's (as on CUDA)."""
    import numpy as np

    from pagedkv.common.protocol import NewRequestData
    from pagedkv.common.sampling_params import SamplingParams
    from pagedkv.worker.input_batch import InputBatch

    dev = torch.device(device)

    class Table(InputBatch):
        on_cpu = property(lambda self: False, lambda self, value: None)  # a device table apart, even on the CPU

    rng = random.Random(7)
    batch = Table(2, 512, 16, 64, dev)
    good, count = True, 0
    for step in range(200):
        for _ in range(rng.randint(0, 3)):
            op = rng.random()
            if batch.num_rows and op < 0.25:
                batch.remove(rng.choice([r for r in batch.request_ids[:batch.num_rows]]))
            elif batch.num_rows and op < 0.7:
                row = rng.randrange(batch.num_rows)
                nb = int(batch.num_blocks[row])
                new = [rng.randrange(10_000) for _ in range(rng.randint(0, min(3, batch.max_blocks - nb)))]
                replaced = [(c, rng.randrange(10_000)) for c in rng.sample(range(nb), min(nb, rng.randint(0, 3)))]
                batch.append_blocks(row, new, replaced)
            else:
                count += 1
                blocks = [rng.randrange(10_000) for _ in range(rng.randint(1, 8))]
                batch.add(NewRequestData(f"q{count}", [1], 1, blocks, 0, 1, SamplingParams()))
        if rng.random() < 0.7:  # else the writes wait, as after a step that computed nothing
            batch.flush_block_table()
            for row in range(batch.num_rows):
                nb = int(batch.num_blocks[row])
                good &= bool(np.array_equal(batch.block_table_dev[row, :nb].cpu().numpy(), batch.block_table[row, :nb]))
    print(f"  device block table through 200 random steps (rows grew to {batch.capacity}): "
          f"{'OK' if good else 'FAIL'}", flush=True)
    return good


def check_profile() -> bool:
    """CUDA only: the memory profile's peak (`ModelRunner.profile_run`, less its temporary cache) covers a
    served step that scores prompt logprobs over max_num_batched_tokens tokens (every token's logits and
    their log-softmax; a 32K vocabulary makes those the step's largest tensors)."""
    from pagedkv.common.config import EMBEDDED_HF_CONFIG, EngineConfig, ModelConfig
    from pagedkv.common.protocol import NewRequestData, StepPlan
    from pagedkv.common.sampling_params import SamplingParams
    from pagedkv.worker.model_runner import ModelRunner

    if not torch.cuda.is_available():
        return True
    dev = torch.device("cuda")
    model = ModelConfig.from_hf_dict(dict(EMBEDDED_HF_CONFIG, vocab_size=32000), "profile-check", None)
    n = 2048
    runner = ModelRunner(EngineConfig(max_num_batched_tokens=n, max_num_seqs=16, enforce_eager=True), dev,
                         torch.float32, model)

    def peak(run) -> int:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        extra = run()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base - (extra or 0)

    profiled = peak(runner.profile_run)
    runner.init_cache(n // 16 + 1, 0)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=20)
    prompt = [(7 * j) % 31000 + 1 for j in range(n)]
    served = peak(lambda: runner.execute(StepPlan(0, new_requests=[
        NewRequestData("p", prompt, n, list(range(n // 16)), 0, n, params)])) and None)
    good = served <= profiled * 1.01 + (1 << 20)
    print(f"  memory profile {profiled / 2**20:.0f} MiB against a served {n}-token prompt-logprobs step "
          f"{served / 2**20:.0f} MiB: {'OK' if good else 'FAIL'}", flush=True)
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
    root = Path(__file__).resolve().parents[1]  # shared/ inside the repository (a lent GPU gets only it), or beside it
    p.add_argument("--model-config", default=str(next(
        (d for d in (root / "shared/model-configs/llama-3.1-8b", root.parent / "shared/model-configs/llama-3.1-8b")
         if d.is_dir()), root.parent / "shared/model-configs/llama-3.1-8b")))
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
