"""The contiguous baseline: one run of physical blocks per request, reserved at admission.

Before paging, serving systems (FasterTransformer, Orca) stored each request's KV cache in one
contiguous region sized for its maximum length, reserved when the request is admitted
(PagedAttention, Kwon et al., SOSP 2023, §3 and Fig. 3). This allocator reproduces that inside
pagedkv's control plane so both can be measured on the same trace, memory, model and kernels:

- at admission a request gets ``ceil(min(prompt + max_tokens, max_model_len) / block_size)``
  consecutive physical blocks, taken first fit from the lowest block id;
- its block table is that run (consecutive ids), so the same workers and paged kernels run it;
- it never grows and never shares: no prefix caching, no fork, no copy-on-write;
- the run comes back whole when the request finishes, is aborted or preempted, and merges with
  its free neighbours.

Its waste is then the paper's: reservation (slots held for tokens not generated yet), internal
fragmentation (slots never filled) and external fragmentation (free blocks in runs too short for
the next request). It plugs into the scheduler through `scheduler.scheduler.KVAllocator`, as the
paged `KVCacheManager` does; `pagedkv bench --kv-allocator contiguous` runs it.
"""

from __future__ import annotations

import bisect

from pagedkv.scheduler.request import Request


class ExtentPool:
    """``num_blocks`` physical blocks kept as sorted, coalesced free extents (start, length).

    The pool-side half of the contiguous allocator, with the counters the engine and tests read
    from a `BlockPool` (num_free_blocks, usage, check_invariants).
    """

    num_cached_free_blocks = 0  # no prefix cache in the baseline
    num_evictions = 0

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._starts: list[int] = [0]  # sorted starts of free extents
        self._lengths: dict[int, int] = {0: num_blocks}
        self.num_free_blocks = num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks reserved by live requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_runs(self) -> list[tuple[int, int]]:
        """The free extents as (first block id, length in blocks), lowest id first."""
        return [(s, self._lengths[s]) for s in self._starts]

    @property
    def largest_free_run(self) -> int:
        """Length in blocks of the longest free extent (0 when the pool is full)."""
        return max(self._lengths.values(), default=0)

    def allocate_run(self, n: int) -> int | None:
        """Take the first free extent of at least ``n`` blocks; returns its first block id, or None."""
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length >= n:
                del self._lengths[start]
                if length == n:
                    del self._starts[i]
                else:  # the rest of the extent stays free, in the same sorted position
                    self._starts[i] = start + n
                    self._lengths[start + n] = length - n
                self.num_free_blocks -= n
                return start
        return None

    def free_run(self, start: int, n: int) -> None:
        """Return blocks [start, start + n), merging with adjacent free extents.

        Raises AssertionError when any of them is already free (a double free).
        """
        i = bisect.bisect_left(self._starts, start)
        prev = self._starts[i - 1] if i > 0 else None
        nxt = self._starts[i] if i < len(self._starts) else None
        if (prev is not None and prev + self._lengths[prev] > start) or (nxt is not None and nxt < start + n):
            raise AssertionError(f"double free of blocks [{start}, {start + n})")
        self.num_free_blocks += n
        if nxt is not None and nxt == start + n:  # merge with the extent after
            n += self._lengths.pop(nxt)
            del self._starts[i]
        if prev is not None and prev + self._lengths[prev] == start:  # and with the one before
            self._lengths[prev] += n
        else:
            self._starts.insert(i, start)
            self._lengths[start] = n

    def check_invariants(self, block_tables: list[list[int]]) -> None:
        """Assert that the live block tables and the free extents partition the pool exactly.

        Each table is one run of consecutive ids; no block is held twice or both held and free;
        extents are sorted, disjoint and coalesced. Raises AssertionError naming the violation.
        """
        owner = [0] * self.num_blocks
        for table in block_tables:
            assert table == list(range(table[0], table[0] + len(table))) if table else True, (
                f"block table {table} is not one contiguous run")
            for b in table:
                owner[b] += 1
        free = 0
        end = -1
        for s in self._starts:
            n = self._lengths[s]
            assert n > 0 and s > end, f"free extents overlap or are not coalesced at block {s}"
            for b in range(s, s + n):
                owner[b] += 1
            end, free = s + n, free + n
        assert len(self._lengths) == len(self._starts), "extent index corrupt"
        assert free == self.num_free_blocks, f"free count {self.num_free_blocks} but extents hold {free}"
        bad = next((b for b, c in enumerate(owner) if c != 1), None)
        assert bad is None, f"block {bad} is held {owner[bad]} times (tables + free extents)"


class ContiguousAllocator:
    """The pre-paging KV allocator, with `KVCacheManager`'s interface (see the module docstring).

    block_size in tokens; num_gpu_blocks in blocks; max_model_len in tokens caps a reservation.
    `allocate_slots` returns None when no free run is long enough for a request being admitted
    (the scheduler then stops admitting; a running request never needs more, so it is never
    preempted for space).
    """

    enable_prefix_caching = False
    kind = "contiguous"

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pool = ExtentPool(num_gpu_blocks)

    num_free_cpu_blocks = None  # no host pool: every preemption is a recompute
    num_cached_free_blocks = 0
    cpu_usage = 0.0

    @classmethod
    def factory(cls, block_size: int):
        """The `Engine.start` ``kv_allocator`` argument: (num_gpu_blocks, num_cpu_blocks, max_model_len) -> allocator."""
        return lambda num_gpu_blocks, _num_cpu_blocks, max_model_len: cls(num_gpu_blocks, block_size, max_model_len)

    @property
    def num_gpu_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserved_tokens(self, request: Request) -> int:
        """Tokens reserved for a request: its maximum length, prompt + max_tokens capped by max_model_len."""
        return min(request.num_prompt_tokens + request.sampling.max_tokens, self.max_model_len)

    def reservation_blocks(self, request: Request) -> int:
        """Blocks of the run a request gets at admission (at least what it has already)."""
        return self.blocks_for(max(self.reserved_tokens(request), request.num_tokens))

    def find_cached_prefix(self, request: Request) -> list:
        """Always empty: the baseline has no prefix caching."""
        return []

    def num_blocks_needed(self, steps: list[tuple[Request, int]], *, empty_pool: bool = False) -> int:
        """Free blocks `allocate_slots` takes for ``steps``: each new request's whole run, 0 for a running one.

        empty_pool: the submit check (runs for requests with no blocks). Raises ValueError for more
        than one sequence: this allocator cannot share blocks (n > 1, beam search).
        Blocks are counted, not placed: a free total that fits may still lack a long enough run.
        """
        if empty_pool and len(steps) > 1:
            raise ValueError("n: the contiguous KV allocator cannot share blocks; n > 1 and beam search "
                             "need the paged allocator")
        return sum(self.reservation_blocks(r) for r, _ in steps if empty_pool or not r.block_table)

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list | None = None) -> list[int] | None:
        """Reserve the request's run at admission (first fit); afterwards nothing to do.

        Returns the block ids appended to the table (the whole run at admission, [] later), or
        None, with no state changed, when no free run is long enough.
        Raises RuntimeError if a running request outgrows its reservation (the engine's length
        checks make that a bug) and ValueError if given cached blocks (there is no prefix cache).
        """
        if cached_blocks:
            raise ValueError("the contiguous allocator has no prefix cache")
        if request.block_table:
            if self.blocks_for(request.num_computed_tokens + num_new_tokens) > len(request.block_table):
                raise RuntimeError(f"request {request.request_id!r} outgrew its contiguous reservation of "
                                   f"{len(request.block_table)} blocks")
            return []
        n = self.reservation_blocks(request)
        start = self.pool.allocate_run(n)
        if start is None:
            return None
        request.block_table = list(range(start, start + n))
        return list(request.block_table)

    def free(self, request: Request) -> None:
        """Give the request's run back whole; its progress resets (as for a recompute preemption)."""
        if request.block_table:
            self.pool.free_run(request.block_table[0], len(request.block_table))
        request.block_table = []
        request.num_computed_tokens = 0

    def fork(self, parent: Request, child: Request) -> None:
        """Not supported: sharing blocks between requests is what paging adds.

        Raises NotImplementedError always; the engine rejects n > 1 and beam search under this
        allocator before they get here.
        """
        raise NotImplementedError("the contiguous KV allocator cannot share blocks (n > 1, beam search); "
                                  "use the paged allocator")

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Always []: without sharing there is no copy-on-write."""
        return []

    def take_replaced_blocks(self, request: Request) -> list[tuple[int, int]]:
        """Always []: without sharing there is no copy-on-write."""
        return []

    def swap_out(self, group: list[Request]) -> list[tuple[int, int]]:
        """Not supported (no host pool; ``num_free_cpu_blocks`` is None, so the policy never asks)."""
        raise NotImplementedError("the contiguous KV allocator has no host pool")

    swap_in = swap_out

    def free_host(self, request: Request) -> None:
        """Nothing to free: nothing is ever swapped out."""

    def host_block_table(self, request: Request) -> list[int]:
        return []

    def snapshot(self) -> dict:
        """JSON-ready view of the pool, in `KVCacheManager.snapshot`'s shape plus the free extents."""
        refs: dict[str, int] = {}
        start = 0
        for s, n in self.pool.free_runs() + [(self.pool.num_blocks, 0)]:
            refs.update((str(b), 1) for b in range(start, s))  # every non-free block has one holder
            start = s + n
        return {
            "allocator": self.kind,
            "block_size": self.block_size,
            "num_gpu_blocks": self.pool.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_free_blocks": 0,
            "usage": self.pool.usage,
            "prefix_caching": False,
            "free_runs": self.pool.free_runs(),
            "block_ref_counts": refs,
            "cached_free_block_ids": [],
            "num_cpu_blocks": 0,
            "num_free_cpu_blocks": 0,
            "cpu_usage": 0.0,
        }
