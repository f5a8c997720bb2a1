"""Where an engine step's wall time goes in a saturated trace replay: control plane, channel, worker.

Runs `pagedkv bench`'s in-process replay (``bench.replay.run_in_process``: all requests at once,
random prompts of the trace's scaled lengths) with `WorkerClient.step` timed. For each step:

- **worker**: ``StepResult.forward_seconds``, the worker's own wall time for swaps, copies, input
  preparation, forward and sampling;
- **channel**: the ``step()`` round trip minus that: sealing and encoding the plan, ZeroMQ both
  ways, the worker's plan decoding, and the result's decoding;
- **control plane**: the rest of the loop iteration (from one ``step()`` return to the next
  ``step()`` call): applying the result, detokenizing, streaming to the bench's clients,
  scheduling the next step, the bench's per-step KV accounting.

Prints medians per band of running requests (decode-only steps and steps with a prefill apart)
and a least-squares fit of each part against running requests over the decode-only steps.

The engine runs with ``async_scheduling`` off, so the three parts follow each other and add up
to the step. With ``--async-scheduling`` (the engine's default) the control plane works while
the worker computes the next step and the parts no longer add up; it prints only how much of
the replay's wall time the worker was computing (the sum of ``forward_seconds``), as it does for
the serial loop:

    python ops/bench_step_anatomy.py --model ../shared/models/stories260K --async-scheduling

    python ops/bench_step_anatomy.py --model ../shared/models/stories260K --trace conv --num-requests 200

Another tree's interpreter runs it against that tree's code (e.g. ``/work/wt/base/.venv/bin/python``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from pagedkv.common.config import EngineConfig, ModelConfig, resolve_max_model_len
from pagedkv.scheduler.worker_client import WorkerClient

try:
    from pagedkv.bench.replay import auto_token_scale, build_requests, load_trace, resolve_trace, run_in_process
except ImportError:  # the tree before issue 10 (d863b9d), run with its own venv, kept the bench in scheduler/
    from pagedkv.scheduler.bench import auto_token_scale, build_requests, load_trace, resolve_trace, run_in_process


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    return slope, my - slope * mx


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--trace", default="conv")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens (default: as the worker sizes it)")
    p.add_argument("--max-tokens", default="trace", choices=["trace", "max-model-len"])
    p.add_argument("--kv-allocator", default=None, help="paged | contiguous (this tree's bench)")
    p.add_argument("--no-kv-accounting", action="store_true", help="skip the bench's KV accounting after every step")
    p.add_argument("--async-scheduling", action="store_true",
                   help="run the engine's default loop (next step sent before the last result is taken); "
                        "print the worker's busy share only")
    args = p.parse_args()
    extra = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    if args.kv_cache_tokens:
        extra["num_gpu_blocks"] = args.kv_cache_tokens // EngineConfig().block_size
    if "async_scheduling" in EngineConfig.__struct_fields__:  # trees before it had only the serial loop
        extra["async_scheduling"] = args.async_scheduling
    config = EngineConfig(model=args.model, load_format=args.load_format, **extra)
    max_model_len = resolve_max_model_len(ModelConfig.load(args.model), config.max_model_len)
    rows = load_trace(resolve_trace(args.trace))
    requests, _ = build_requests(rows, args.num_requests, max_model_len, auto_token_scale(rows, max_model_len),
                                 request_rate=float("inf"), max_tokens_policy=args.max_tokens)

    steps = []  # (running, new tokens, prefill?, worker s, channel s, control plane s)
    last_return = [None]
    # process CPU from the first step sent to the last result: the replay's window, as its wall time
    # (process_time() around run_in_process also counted engine start, model load and shutdown)
    cpu_window = [None, None]
    sent: dict[int, tuple[float, object]] = {}  # step id -> (time sent, plan)
    original = {name: getattr(WorkerClient, name) for name in ("step", "submit", "result") if hasattr(WorkerClient, name)}

    def record(plan, t0: float, t1: float, result) -> None:
        control = t0 - last_return[0] if last_return[0] is not None else 0.0  # the first step: none before it
        last_return[0] = t1
        cpu_window[1] = time.process_time()
        running = len(plan.new_requests) + len(plan.cached_requests)
        prefill = bool(plan.new_requests) or plan.num_scheduled_tokens > running
        steps.append((running, plan.num_scheduled_tokens, prefill, result.forward_seconds,
                      t1 - t0 - result.forward_seconds, control))

    async def timed_step(self, plan):  # trees whose loop calls step()
        if cpu_window[0] is None:
            cpu_window[0] = time.process_time()
        t0 = time.perf_counter()
        result = await original["step"](self, plan)
        record(plan, t0, time.perf_counter(), result)
        return result

    async def timed_submit(self, plan):
        if cpu_window[0] is None:
            cpu_window[0] = time.process_time()
        sent[plan.step_id] = (time.perf_counter(), plan)
        return await original["submit"](self, plan)

    async def timed_result(self, step_id):
        result = await original["result"](self, step_id)
        t0, plan = sent.pop(step_id)
        record(plan, t0, time.perf_counter(), result)
        return result

    if "result" in original:
        WorkerClient.submit, WorkerClient.result = timed_submit, timed_result
    else:
        WorkerClient.step = timed_step
    run = await run_in_process(config, requests, progress=False, account_kv_every_step=not args.no_kv_accounting,
                               **({"kv_allocator": args.kv_allocator} if args.kv_allocator else {}))
    cpu = cpu_window[1] - cpu_window[0]
    for name, fn in original.items():
        setattr(WorkerClient, name, fn)
    # the control-plane time before step i is the gap after step i - 1: attribute it to step i
    rows = steps
    print(f"{args.trace}, {len(requests)} requests at once: {len(steps)} steps, "
          f"{run['output_token_throughput']:.1f} output tok/s, {run['num_preemptions']} preemptions, "
          f"control-plane process CPU {cpu:.2f} s over {run['duration_s']:.2f} s wall")
    wall = run["duration_s"]
    print(f"worker computing {sum(s[3] for s in steps):.2f} s of the replay's {wall:.2f} s wall time "
          f"({100 * sum(s[3] for s in steps) / wall:.0f}%)")
    if args.async_scheduling:
        return  # the parts overlap: a per-step split would not add up
    print(f"{'running':>9} {'kind':>8} {'steps':>6} {'tokens':>7} {'worker ms':>10} {'channel ms':>11} "
          f"{'control ms':>11} {'step ms':>8}")
    bands = [(1, 16), (17, 64), (65, 128), (129, 192), (193, 256)]
    for lo, hi in bands:
        for kind in (False, True):
            sel = [s for s in rows if lo <= s[0] <= hi and s[2] == kind]
            if not sel:
                continue
            med = [1000 * statistics.median(s[i] for s in sel) for i in (3, 4, 5)]
            print(f"{lo:>4}-{hi:<4} {'prefill' if kind else 'decode':>8} {len(sel):>6} "
                  f"{statistics.median(s[1] for s in sel):>7.0f} {med[0]:>10.2f} {med[1]:>11.2f} {med[2]:>11.2f} "
                  f"{sum(med):>8.2f}")
    decode = [s for s in rows if not s[2]]
    pre = [s for s in rows if s[2]]
    print(f"sum over steps (s): decode-only {sum(sum(s[3:6]) for s in decode):.2f} in {len(decode)} steps, "
          f"with a prefill {sum(sum(s[3:6]) for s in pre):.2f} in {len(pre)} steps "
          f"(worker {sum(s[3] for s in pre):.2f} of it)")
    if len({s[0] for s in decode}) > 1:
        xs = [s[0] for s in decode]
        parts = {"worker": [s[3] for s in decode], "channel": [s[4] for s in decode],
                 "control plane": [s[5] for s in decode]}
        parts["whole step"] = [a + b + c for a, b, c in zip(*parts.values())]
        print(f"least-squares over {len(decode)} decode-only steps (ms per running request, intercept ms):")
        for name, ys in parts.items():
            slope, icpt = _fit(xs, ys)
            print(f"  {name:>14}: {1000 * slope:.4f}, {1000 * icpt:.2f}")



if __name__ == "__main__":
    asyncio.run(main())
