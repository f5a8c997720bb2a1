"""KV token-state accounting: what every slot of the KV pool holds, at one instant.

In token slots (PagedAttention, Kwon et al., SOSP 2023, §3, Fig. 2); `pagedkv bench` samples it
after every engine step and when the engine goes idle (in-process) or by polling ``/kv_cache`` (``--url``):

- pool = num_gpu_blocks x block_size; allocated = slots of blocks held by live requests
  (each physical block once); free = pool - allocated.
- For a request with c computed tokens that will hold F = min(prompt + L, max_model_len) - 1
  tokens' K/V at the end (L: the tokens it will generate, max_tokens unless the benchmark knows it
  stops earlier; the last sampled token is never fed back), the slots of its blocks
  in logical order are: token state (index < c), reservation (c <= index < F: slots for tokens it
  will compute but has not yet), internal fragmentation (index >= F: slots it will never fill,
  the over-reservation of the contiguous baseline, or the unfilled tail of the last block with
  paging). A block shared by several requests counts once, each slot in its best class.
- external fragmentation = free slots in free runs shorter than the blocks the head of the
  waiting queue needs to be admitted, counted while those runs are what keeps it out: the pool has
  the blocks free but no run of them long enough (then every free slot is in such a run). 0 when
  nothing waits; 0 when a run fits the head (it waits for the next step, as a request that arrived
  during this one does in trace-timed replay, or for a seat or token budget, not for memory);
  0 when the free blocks would not hold it even as one run (too little memory, not fragmentation);
  0 with paging by construction, since paging needs one block at a time from anywhere.

Identities (checked exactly, in integer slots): token_state + reservation + internal = allocated,
allocated + free = pool, 0 <= external <= free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVSample:
    """KV slot accounting at one instant (see the module docstring); sizes in token slots."""

    t: float
    pool: int
    allocated: int
    token_state: int
    reservation: int
    internal: int
    external: int
    free: int
    running: int
    waiting: int


def account_kv(t: float, block_size: int, num_blocks: int, num_free_blocks: int,
               holders: list[tuple[list[int], int, int]], free_runs, head_need_blocks: int,
               running: int, waiting: int) -> KVSample:
    """Classify every slot of the pool. holders: (block table, computed tokens, final tokens) per live
    request; free_runs: a callable giving the free runs' lengths in blocks (only called when the
    head could fit in the free blocks); head_need_blocks: blocks the head of the waiting queue
    needs (0: none waits).
    """
    bs = block_size
    state = fill = alloc = 0
    if sum(len(tb) for tb, _, _ in holders) == num_blocks - num_free_blocks:
        for table, c, f in holders:  # no block is shared: per-request arithmetic
            cap = len(table) * bs
            alloc += cap
            state += min(c, cap)
            fill += min(max(f, c), cap)
    else:  # shared blocks (prefix cache, n > 1): each physical block once, its slots in their best class
        per_block: dict[int, list[int]] = {}
        for table, c, f in holders:
            for i, b in enumerate(table):
                s, r = min(bs, max(0, c - i * bs)), min(bs, max(0, f - i * bs, c - i * bs))
                cur = per_block.setdefault(b, [0, 0])
                cur[0], cur[1] = max(cur[0], s), max(cur[1], r)
        alloc = len(per_block) * bs
        state = sum(s for s, _ in per_block.values())
        fill = sum(r for _, r in per_block.values())
    external = 0
    if 1 < head_need_blocks <= num_free_blocks:
        runs = free_runs()
        if max(runs, default=0) < head_need_blocks:  # enough free blocks, no run long enough
            external = sum(runs) * bs
    pool = num_blocks * bs
    return KVSample(t, pool, alloc, state, fill - state, alloc - fill, external, pool - alloc, running, waiting)


def _final_tokens(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    return min(prompt_len + max_tokens, max_model_len) - 1


def sample_engine(engine, t: float, output_len: dict[str, int] | None = None) -> KVSample:
    """Account the in-process engine's KV pool right now.

    output_len: request id -> tokens it will really generate, where that is less than max_tokens.
    """
    kv, sched = engine.kv, engine.scheduler
    output_len = output_len or {}
    holders = [(r.block_table, r.num_computed_tokens,
                _final_tokens(r.num_prompt_tokens, output_len.get(r.request_id, r.sampling.max_tokens),
                              engine.max_model_len))
               for r in sched.requests.values() if r.block_table and r.status.value != "swapped"]
    need = 0
    if sched.waiting:
        need = kv.reservation_blocks(sched.waiting.peek()) if hasattr(kv, "reservation_blocks") else 1
    runs = (lambda: [n for _, n in kv.pool.free_runs()]) if hasattr(kv.pool, "free_runs") else (lambda: [])
    return account_kv(t, kv.block_size, kv.num_gpu_blocks, kv.num_free_blocks, holders, runs, need,
                      len(sched.running), len(sched.waiting))


def sample_snapshot(snap: dict, t: float, max_model_len: int) -> KVSample:
    """Account a ``/kv_cache`` snapshot (`Engine.kv_cache_snapshot`)."""
    bs = snap["block_size"]
    reqs = snap["requests"]
    holders = [(r["block_table"], r["num_computed_tokens"],
                _final_tokens(r["num_prompt_tokens"], r["max_tokens"], max_model_len))
               for r in reqs if r["block_table"] and r["status"] != "swapped"]
    waiting = [r for r in reqs if r["status"] == "waiting"]  # servers before queue_position: arrival order
    head = min(waiting, key=lambda r: r.get("queue_position") or 0) if waiting else None
    need = 0
    if head is not None:
        need = 1
        if snap.get("allocator") == "contiguous":
            need = -(-max(min(head["num_prompt_tokens"] + head["max_tokens"], max_model_len), head["num_tokens"]) // bs)
    runs = lambda: [n for _, n in snap.get("free_runs", [])]  # noqa: E731
    return account_kv(t, bs, snap["num_gpu_blocks"], snap["num_free_blocks"], holders, runs, need,
                      snap["num_requests_running"], snap["num_requests_waiting"])


def summarize_kv(samples: list[KVSample]) -> dict:
    """Time-weighted totals over samples and the derived fractions.

    Each sample holds until the next one (as for `running_stats`): the fractions are of slot-seconds,
    so a long step weighs more than a short one. Weighting by step instead made the two
    allocators' figures depend on their step lengths (paged steps, with bigger batches, are longer).
    slot_totals: the plain per-sample integer sums (the identities hold on them exactly).
    utilization = token_state / allocated; each waste is also given as a fraction of allocated
    (reservation, internal) or of the pool (external, free), with token state / pool.
    """
    keys = ("pool", "allocated", "token_state", "reservation", "internal", "external", "free")
    tot = {k: sum(getattr(s, k) for s in samples) for k in keys}
    # the last sample holds for no time; with no time span (one sample) every sample weighs alike
    w = [b.t - a.t for a, b in zip(samples, samples[1:])] + [0.0]
    if sum(w) <= 0:
        w = [1.0] * len(samples)
    wt = {k: sum(x * getattr(s, k) for x, s in zip(w, samples)) for k in keys}
    busy = [s for s in samples if s.allocated]
    a, p = wt["allocated"] or 1, wt["pool"] or 1
    return {
        "num_samples": len(samples),
        "slot_totals": tot,
        "utilization": wt["token_state"] / a,
        "reservation_frac": wt["reservation"] / a,
        "internal_frac": wt["internal"] / a,
        "external_frac_of_pool": wt["external"] / p,
        "token_state_frac_of_pool": wt["token_state"] / p,
        "allocated_frac_of_pool": wt["allocated"] / p,
        "mean_step_utilization": sum(s.token_state / s.allocated for s in busy) / len(busy) if busy else None,
    }


def running_stats(samples: list[KVSample]) -> tuple[int, float]:
    """Peak and time-weighted mean of running requests (each sample holds until the next one)."""
    if not samples:
        return 0, 0.0
    span = samples[-1].t - samples[0].t
    if span <= 0:
        return max(s.running for s in samples), float(samples[0].running)
    area = sum(a.running * (b.t - a.t) for a, b in zip(samples, samples[1:]))
    return max(s.running for s in samples), area / span


def step_time_fit(points: list[tuple[float, int]]) -> dict | None:
    """Least-squares fit of engine step time (s) against running requests, from (t, running) samples.

    Each step's duration is the time to the next sample, paired with the next sample's running
    count. Tells whether a bigger batch costs more per step (compute-bound, as on a CPU) or
    nearly nothing (memory-bound decode, as on a GPU), which decides what concurrency buys.
    """
    xs = [b[1] for b in points[1:]]
    ys = [b[0] - a[0] for a, b in zip(points, points[1:])]
    if len(xs) < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"intercept_ms": 1000 * (my - slope * mx), "per_running_request_ms": 1000 * slope, "num_steps": len(xs)}
