"""Preemption policy: which running request gives its blocks up, and how (PagedAttention §4.5).

Decisions only: the policy reads requests and figures and returns a choice; the scheduler carries
it out through the KV cache manager.

Victim: under ``fcfs`` the most recently admitted running request (the tail of the running queue);
under ``priority`` the lowest-priority (highest ``priority`` value, as vLLM), latest-arrived one. A
victim's whole sibling group (n > 1, beam search) is preempted with it: siblings share blocks, and
freeing only some of them would free nothing the others do not still hold.

Mode, per victim: ``recompute`` frees its blocks and later prefills prompt + generated tokens again;
``swap`` copies its blocks to the host pool and back. ``auto`` takes the cheaper by this cost model:
swap = 2 x bytes of the victim's distinct blocks / host<->device bandwidth (out now, back in later;
bandwidth measured by the worker at start, copying blocks of the configured size one by one as a
swap does), recompute = tokens whose KV is discarded /
prefill throughput (tokens per second of recent steps that prefilled, from the worker's
``forward_seconds``). Both are seconds of worker time; neither counts the waiting in between, which
is the same either way. Each side is linear, so the choice mostly follows the ratio bytes per token /
bandwidth versus 1 / throughput: swap wins on large models with fast links, recompute on small models
and slow links (the paper's Fig. 19, §7.3). A victim whose blocks do not fit in the free host blocks is
recomputed whatever the mode, so nothing ever waits on the host pool.
"""

from __future__ import annotations

import enum
import time
from collections import deque

import msgspec

from pagedkv.common.protocol import StepPlan
from pagedkv.scheduler.request import Request

# Priors used until the first measurement: a PCIe 4.0 x16 link in practice, and a small model's
# prefill on one accelerator. They only decide preemptions made before the first prefill step.
DEFAULT_SWAP_BANDWIDTH = 16e9  # bytes/s, one direction
DEFAULT_PREFILL_THROUGHPUT = 10_000.0  # tokens/s


class PreemptionMode(str, enum.Enum):
    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class Preemption(msgspec.Struct):
    """One preemption decision: what was preempted, how, why, and what each way would have cost.

    request_ids: the victim and the siblings preempted with it. num_blocks: distinct device blocks
    freed. num_tokens: tokens whose KV is discarded (recompute) or kept on the host (swap), a
    prompt shared by siblings once.
    num_bytes: bytes a swap moves one way (num_blocks x kv_bytes_per_block). swap_cost_s /
    recompute_cost_s: the model's estimates in seconds. fallback: why ``mode`` differs from
    what the policy asked for (the host pool was full), else None. time: time.monotonic() seconds.
    """

    request_ids: list[str]
    mode: str  # "swap" | "recompute": what was done
    reason: str
    num_blocks: int
    num_tokens: int
    num_bytes: int
    swap_cost_s: float
    recompute_cost_s: float
    fallback: str | None = None
    time: float = 0.0


class Resumption(msgspec.Struct):
    """A preempted request runs again: ``mode`` is "swap_in" or "recompute".

    num_blocks: blocks in its table after a swap-in, or blocks found in the prefix cache on a
    recompute. time: time.monotonic() seconds.
    """

    request_id: str
    mode: str
    num_blocks: int
    time: float


class PrefillThroughput:
    """Tokens per second of recent prefill steps: total tokens / total forward seconds over a window.

    Only steps that prefilled (a new request, or more than one token for a request) and swapped
    nothing count: decode-only steps measure per-step overhead rather than the cost of a prefill,
    and a step's swaps are part of its ``forward_seconds``.
    """

    def __init__(self, prior: float = DEFAULT_PREFILL_THROUGHPUT, window: int = 32):
        self.prior = prior
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)

    def observe(self, plan: StepPlan, forward_seconds: float) -> None:
        if plan.blocks_to_swap_out or plan.blocks_to_swap_in or forward_seconds <= 0:
            return
        if plan.new_requests or any(r.num_scheduled_tokens > 1 for r in plan.cached_requests):
            self._steps.append((plan.num_scheduled_tokens, forward_seconds))

    @property
    def tokens_per_second(self) -> float:
        seconds = sum(s for _, s in self._steps)
        return sum(n for n, _ in self._steps) / seconds if seconds > 0 else self.prior


class PreemptionPolicy:
    """Victim choice and per-victim mode choice.

    kv_bytes_per_block: bytes of one block's K and V across layers (the worker's WorkerHello).
    swap_bandwidth: host<->device copy bandwidth, bytes/s one way (WorkerHello.swap_bandwidth;
    tests override the attribute). Raises ValueError for an unknown mode or scheduling policy.
    """

    def __init__(self, mode: str = "recompute", scheduling_policy: str = "fcfs",
                 kv_bytes_per_block: int = 0, swap_bandwidth: float | None = None):
        self.mode = PreemptionMode(mode)
        self.scheduling_policy = SchedulingPolicy(scheduling_policy)
        self.kv_bytes_per_block = kv_bytes_per_block
        self.swap_bandwidth = swap_bandwidth or DEFAULT_SWAP_BANDWIDTH
        self.prefill = PrefillThroughput()

    # ---- victim -----------------------------------------------------------------------------

    def victim(self, running: list[Request]) -> Request:
        """The running request to preempt next. Raises ValueError when ``running`` is empty."""
        if not running:
            raise ValueError("no running request to preempt")
        if self.scheduling_policy is SchedulingPolicy.PRIORITY:
            # ties on arrival: the later admitted (max keeps the first maximum, so scan from the tail)
            return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))
        return running[-1]

    # ---- mode -------------------------------------------------------------------------------

    def costs(self, group: list[Request]) -> tuple[int, int, float, float]:
        """(distinct blocks, tokens with KV, swap cost s, recompute cost s) of preempting ``group``."""
        num_blocks = len({b for r in group for b in r.block_table})
        # siblings share the prompt up to the fork point: a recompute computes it once (the leader,
        # `Scheduler._requeue`) and a swap keeps it once, so each other sibling counts only the rest
        leader = group[0]
        shared = sum(min(r.num_computed_tokens, leader.fork_point) for r in group[1:] if r.group is leader.group)
        num_tokens = sum(r.num_computed_tokens for r in group) - shared
        swap_s = 2 * num_blocks * self.kv_bytes_per_block / self.swap_bandwidth
        recompute_s = num_tokens / self.prefill.tokens_per_second
        return num_blocks, num_tokens, swap_s, recompute_s

    def decide(self, group: list[Request], reason: str, num_free_cpu_blocks: int | None) -> Preemption:
        """Choose how to preempt ``group`` (the victim and its live siblings); changes nothing.

        num_free_cpu_blocks: free blocks of the host pool, None when the allocator cannot swap.
        Swap when the mode is ``swap``, or ``auto`` and swap is cheaper; recompute otherwise, and
        also when the host pool cannot take every distinct block of the group (``fallback`` says so).
        """
        num_blocks, num_tokens, swap_s, recompute_s = self.costs(group)
        want_swap = self.mode is PreemptionMode.SWAP or (self.mode is PreemptionMode.AUTO and swap_s < recompute_s)
        fallback = None
        if want_swap and num_tokens == 0:
            want_swap, fallback = False, "no computed tokens: nothing to keep"
        elif want_swap and num_free_cpu_blocks is None:
            want_swap, fallback = False, "no host pool (the allocator cannot swap)"
        elif want_swap and num_blocks > num_free_cpu_blocks:
            want_swap, fallback = False, f"host pool full: {num_blocks} blocks needed, {num_free_cpu_blocks} free"
        return Preemption(
            request_ids=[r.request_id for r in group], mode="swap" if want_swap else "recompute", reason=reason,
            num_blocks=num_blocks, num_tokens=num_tokens, num_bytes=num_blocks * self.kv_bytes_per_block,
            swap_cost_s=swap_s, recompute_cost_s=recompute_s, fallback=fallback, time=time.monotonic())
