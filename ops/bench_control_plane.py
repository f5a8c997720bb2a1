"""Control-plane cost per engine step, with the worker replaced by one that answers instantly.

What the GPU would wait for between two forwards: the scheduler's step (admission, block
allocation, block-table deltas, prefix-cache hashing of blocks that filled), the StepPlan's
MessagePack encode + decode (the worker's side of ZeroMQ, minus the socket), the StepResult's
encode + decode, and applying the result (advance, append the sampled token). At steady-state
decode with N running requests; the fake worker returns one token per scheduled request.

    python ops/bench_control_plane.py --sizes 16,64,256,1024 --steps 200 [--profile 256] [--json out.json]

Goal (issue 6): at most 1 ms per step at 256 running requests.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import pstats
import random
import statistics
import sys
import time

from pagedkv.common.protocol import SampledToken, StepResult, decode_from_worker, decode_to_worker, encode
from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import Request
from pagedkv.scheduler.scheduler import Scheduler

PHASES = ("schedule", "plan_codec", "result_codec", "apply")


def setup(num_requests: int, prompt_len: int, block_size: int, steps: int, seed: int = 0) -> Scheduler:
    """A scheduler with ``num_requests`` distinct random prompts, all prefilled and decoding."""
    rng = random.Random(seed)
    per_req = -(-(prompt_len + block_size + steps + 64) // block_size)
    kv = KVCacheManager(num_requests * per_req + 16, block_size, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_seqs=num_requests, max_num_batched_tokens=max(2048, num_requests * prompt_len))
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)
    for i in range(num_requests):
        # lengths spread over a block, so requests cross block boundaries on different steps
        n = prompt_len + rng.randrange(block_size)
        sched.add(Request(f"req-{i}", [rng.randrange(32000) for _ in range(n)], params))
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        step(sched)  # admission and prefill: not measured
    return sched


def step(sched: Scheduler, times: dict[str, list[int]] | None = None) -> None:
    """One engine step against the instant fake worker; phase times (ns) appended to ``times``."""
    t0 = time.perf_counter_ns()
    scheduled = sched.schedule()
    t1 = time.perf_counter_ns()
    plan = decode_to_worker(encode(scheduled.plan))  # what the worker receives
    t2 = time.perf_counter_ns()
    sampled = [SampledToken(r.request_id, 7) for r in plan.new_requests] + [
        SampledToken(r.request_id, 7) for r in plan.cached_requests]
    result = decode_from_worker(encode(StepResult(plan.step_id, sampled)))
    t3 = time.perf_counter_ns()
    sched.advance(scheduled)
    for s in result.sampled:
        req = sched.requests[s.request_id]
        if req.num_computed_tokens == req.num_tokens:  # its last known token was computed: sample lands
            req.token_ids.append(s.token_id)
    t4 = time.perf_counter_ns()
    if times is not None:
        for k, a, b in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4)):
            times[k].append(b - a)


def measure(num_requests: int, steps: int, prompt_len: int = 32, block_size: int = 16) -> dict:
    """Median and p90 per phase and in total (ms per step) over ``steps`` decode steps."""
    sched = setup(num_requests, prompt_len, block_size, steps)
    times: dict[str, list[int]] = {k: [] for k in PHASES}
    for _ in range(steps):
        step(sched, times)
    assert len(sched.running) == num_requests, "every request must still be running"
    totals = [sum(v) for v in zip(*times.values())]
    ms = lambda ns: ns / 1e6  # noqa: E731
    return {"running": num_requests, "steps": steps,
            "total_ms_median": ms(statistics.median(totals)),
            # nearest rank: int(0.9 * (n - 1)) rounded down, below the median for a few steps
            "total_ms_p90": ms(sorted(totals)[math.ceil(0.9 * len(totals)) - 1]),
            **{f"{k}_ms_median": ms(statistics.median(v)) for k, v in times.items()}}


def profile(num_requests: int, steps: int, top: int = 15) -> str:
    """cProfile of ``steps`` decode steps at ``num_requests`` running: top functions by own time."""
    sched = setup(num_requests, 32, 16, steps)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(sched)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,64,256,1024", help="running requests, comma-separated")
    p.add_argument("--steps", type=int, default=200, help="measured decode steps per size")
    p.add_argument("--profile", type=int, default=None, metavar="N", help="also profile at N running requests")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        p.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if any(s < 1 for s in sizes):
        p.error("--sizes must be >= 1")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    rows = [measure(n, args.steps) for n in sizes]
    print("| running | total ms/step (median) | p90 | schedule | plan enc+dec | result enc+dec | apply |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['running']} | {r['total_ms_median']:.3f} | {r['total_ms_p90']:.3f} | {r['schedule_ms_median']:.3f} "
              f"| {r['plan_codec_ms_median']:.3f} | {r['result_codec_ms_median']:.3f} | {r['apply_ms_median']:.3f} |")
    if args.profile:
        print(profile(args.profile, args.steps))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
