"""Tuning advice from live metrics: preemption is a safety valve, not a normal state.

The seed's operating advice, as rules over the last ``window_s`` seconds of the engine's state,
sampled every ``interval_s`` seconds (uniform samples, so their means are time averages):

- ``preemption_pressure``: at least ``min_preemptions`` preemptions in the window and at least
  ``preemptions_per_min`` per minute. The pool cannot hold the batch the scheduler admits: lower
  ``--max-num-seqs`` to the number of requests of the window's mean final length (prompt + output,
  in blocks) that fit in the pool, ``floor(num_gpu_blocks / mean_blocks)``; or quantize the KV
  cache (``--kv-cache-dtype fp8`` stores one byte per element: kv dtype bytes x the blocks); or
  shorten the context limit to the next power of two above the longest request seen, when that is
  below ``--max-model-len``. Each suggestion is given only when it changes something.
- ``underused`` (only without ``preemption_pressure``): over a window of at least ``low_usage_min_s`` seconds, mean usage below
  ``low_usage``, at least ``min_waiting`` requests waiting on average, and the running batch at
  the ``max_num_seqs`` cap in at least ``at_cap_fraction`` of the samples: the cap, not memory,
  limits throughput. Raise ``--max-num-seqs`` to ``ceil(max_num_seqs x target_usage / usage)``,
  no higher than the requests of the mean final length that fit in the pool.
- ``swap_pool_full``: swap or auto preemption, preemptions in the window, and the host pool at
  least ``swap_full`` full on average: victims that do not fit are recomputed; raise
  ``--swap-space``.

`advise` is a pure function of a sample history, the engine's settings and the thresholds, so the
rules are tested on synthetic histories; `Advisor` keeps the live history and logs a line when the
advice changes (at most once per ``log_interval_s``). Served at ``GET /kv_cache/advice``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass

from pagedkv.common.config import _DTYPE_BYTES
from pagedkv.common.log import get_logger

log = get_logger("pagedkv.advice")


@dataclass(frozen=True)
class Thresholds:
    """Every number the rules compare against (module docstring); units: seconds, fractions, counts."""

    window_s: float = 600.0  # advice reads the last 10 minutes
    interval_s: float = 1.0  # one sample per second
    preemptions_per_min: float = 6.0  # one every 10 s or more often: no longer a safety valve
    min_preemptions: int = 6  # and at least this many, so one early preemption is not a "rate"
    low_usage: float = 0.40
    low_usage_min_s: float = 600.0  # usage low for 10 minutes, not a lull
    min_waiting: float = 1.0  # mean requests waiting
    at_cap_fraction: float = 0.5  # share of samples with the running batch at max_num_seqs
    target_usage: float = 0.80  # what a raised max_num_seqs aims for
    swap_full: float = 0.90
    log_interval_s: float = 120.0  # an advice line at most every two minutes


@dataclass(frozen=True)
class Sample:
    """The engine's state at one moment. time: monotonic seconds; usage: fraction of device blocks
    referenced; num_preemptions: preemptions the scheduler made since the engine started (a counter;
    KV pressure only, not the sequences a worker restart preempts)."""

    time: float
    usage: float
    num_running: int
    num_waiting: int
    num_swapped: int
    cpu_usage: float
    num_preemptions: int


@dataclass(frozen=True)
class Settings:
    """The engine's configuration the advice refers to (flag values)."""

    max_num_seqs: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_dtype: str  # the pool's element type: float32 | float16 | bfloat16 | fp8...
    preemption_mode: str  # recompute | swap | auto
    swap_space: float  # GiB


def _next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def advise(samples: list[Sample], finished: list[tuple[float, int]], settings: Settings,
           thresholds: Thresholds = Thresholds()) -> dict:
    """Evaluate the rules over the samples of the last ``window_s`` seconds.

    samples: in time order; finished: (time, final length in tokens) of requests that finished.
    Returns ``{"advice": [{"rule", "message", "flags"}], "observed": {...}, "thresholds": {...}}``;
    ``advice`` is empty when nothing needs changing. JSON-ready.
    """
    t = thresholds
    out = {"advice": [], "observed": {}, "thresholds": asdict(t)}
    if not samples:
        return out
    start = samples[-1].time - t.window_s
    window = [s for s in samples if s.time >= start]
    # open the window at the last sample before its start: live samples come a little over
    # interval_s apart, never exactly window_s before the last, so without it the span always fell
    # short of window_s (underused, which needs low_usage_min_s = window_s, never fired) and the
    # preemptions of the first interval went uncounted
    if (i := len(samples) - len(window)) > 0:  # the window is a suffix of the time-ordered samples
        window.insert(0, samples[i - 1])
    lengths = [n for when, n in finished if when >= start]
    first, last = window[0], window[-1]
    elapsed = last.time - first.time
    n = len(window)
    preemptions = last.num_preemptions - first.num_preemptions
    rate = preemptions / elapsed * 60 if elapsed > 0 else 0.0
    usage = sum(s.usage for s in window) / n
    waiting = sum(s.num_waiting for s in window) / n
    cpu_usage = sum(s.cpu_usage for s in window) / n
    at_cap = sum(s.num_running >= settings.max_num_seqs for s in window) / n
    bs = settings.block_size
    # the mean final length of requests in blocks; without finished requests, the live batch's
    # mean holding (a lower bound on where those requests end)
    if lengths:
        mean_blocks = sum(math.ceil(x / bs) for x in lengths) / len(lengths)
    else:
        held = [(s.usage * settings.num_gpu_blocks, s.num_running) for s in window if s.num_running]
        mean_blocks = sum(b for b, _ in held) / sum(r for _, r in held) if held else 0.0
    fits = math.floor(settings.num_gpu_blocks / mean_blocks) if mean_blocks else None
    # messages quote these rounded figures, not the raw ones: rounding twice could disagree with them
    out["observed"] = obs = {
        "window_s": round(elapsed, 3), "num_samples": n, "preemptions": preemptions,
        "preemptions_per_min": round(rate, 2), "mean_usage": round(usage, 4), "mean_waiting": round(waiting, 2),
        "mean_running": round(sum(s.num_running for s in window) / n, 2), "at_cap_fraction": round(at_cap, 3),
        "mean_cpu_usage": round(cpu_usage, 4), "num_finished": len(lengths),
        "mean_request_blocks": round(mean_blocks, 2), "requests_that_fit": fits,
        "max_request_tokens": max(lengths) if lengths else None, **asdict(settings)}

    if preemptions >= t.min_preemptions and rate >= t.preemptions_per_min:
        parts, flags = [], {}
        if fits is not None and fits < settings.max_num_seqs:
            flags["--max-num-seqs"] = max(fits, 1)
            parts.append(f"lower --max-num-seqs from {settings.max_num_seqs} to ~{flags['--max-num-seqs']} "
                         f"(the pool holds that many requests of {obs['mean_request_blocks']:.1f} blocks)")
        factor = _DTYPE_BYTES.get(settings.kv_cache_dtype, 1)
        if factor > 1:
            flags["--kv-cache-dtype"] = "fp8"
            parts.append(f"--kv-cache-dtype fp8 (≈{factor}× blocks)")
        if lengths and (limit := _next_power_of_two(max(lengths))) < settings.max_model_len:
            flags["--max-model-len"] = limit
            parts.append(f"--max-model-len {limit}")
        action = ", or ".join(parts) if parts else "the pool is too small for the longest requests: add memory"
        out["advice"].append({
            "rule": "preemption_pressure", "flags": flags,
            "message": f"{obs['preemptions_per_min']:.0f} preemptions/min ({settings.preemption_mode}) at "
                       f"{obs['mean_usage']:.0%} usage: {action}"})

    # not while preempting under pressure: a larger batch would preempt more (the advice would contradict itself)
    if (not out["advice"] and elapsed >= t.low_usage_min_s and usage < t.low_usage and waiting >= t.min_waiting
            and at_cap >= t.at_cap_fraction):
        raised = math.ceil(settings.max_num_seqs * t.target_usage / max(usage, 1e-3))
        if fits is not None:
            raised = min(raised, fits)
        if raised > settings.max_num_seqs:
            out["advice"].append({
                "rule": "underused", "flags": {"--max-num-seqs": raised},
                "message": f"usage below {t.low_usage:.0%} for {obs['window_s'] / 60:.0f} min (mean "
                           f"{obs['mean_usage']:.0%}) with {obs['mean_waiting']:.0f} requests waiting at the "
                           f"max_num_seqs cap: raise --max-num-seqs from {settings.max_num_seqs} to ~{raised}"})

    if (settings.preemption_mode in ("swap", "auto") and settings.num_cpu_blocks and preemptions
            and cpu_usage >= t.swap_full):
        out["advice"].append({
            "rule": "swap_pool_full", "flags": {"--swap-space": round(settings.swap_space * 2, 3)},
            "message": f"host swap pool {obs['mean_cpu_usage']:.0%} full while preempting: victims that do not fit are "
                       f"recomputed; raise --swap-space from {settings.swap_space:g} GiB"})
    return out


class Advisor:
    """The live sample history of one engine, its advice, and the log line when the advice changes."""

    def __init__(self, settings: Settings, thresholds: Thresholds = Thresholds()):
        self.settings = settings
        self.thresholds = thresholds
        keep = int(thresholds.window_s / thresholds.interval_s) + 2
        self.samples: deque[Sample] = deque(maxlen=keep)
        self.finished: deque[tuple[float, int]] = deque()
        self._logged: tuple[str, ...] = ()
        self._logged_at: float | None = None

    def record(self, sample: Sample) -> None:
        self.samples.append(sample)
        cutoff = sample.time - self.thresholds.window_s
        while self.finished and self.finished[0][0] < cutoff:
            self.finished.popleft()

    def on_finished(self, time: float, num_tokens: int) -> None:
        """A request finished at ``time`` with ``num_tokens`` tokens (prompt + output)."""
        self.finished.append((time, num_tokens))

    def advice(self) -> dict:
        return advise(list(self.samples), list(self.finished), self.settings, self.thresholds)

    def log_if_changed(self, now: float) -> dict | None:
        """Log the advice when its rules changed since the last line and ``log_interval_s`` has
        passed since then; returns what was logged, or None."""
        if self._logged_at is not None and now - self._logged_at < self.thresholds.log_interval_s:
            return None
        advice = self.advice()
        rules = tuple(a["rule"] for a in advice["advice"])
        if rules == self._logged:
            return None
        self._logged, self._logged_at = rules, now
        if rules:
            for a in advice["advice"]:
                log.warning("kv cache advice", rule=a["rule"], advice=a["message"], flags=a["flags"])
        else:
            log.info("kv cache advice: no change advised", **{k: advice["observed"][k] for k in
                                                                ("preemptions_per_min", "mean_usage")})
        return advice
