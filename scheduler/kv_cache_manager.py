"""The KV cache manager: the one owner of KV memory, device pool and host swap pool.

Each request owns one block table (``request.block_table``, physical block ids in logical order).
A new block is taken only when the last one is full (PagedAttention, Kwon et al., SOSP 2023, §4.2),
and every block goes back when the request finishes, is aborted, fails or is preempted. Every
question "how many free blocks does this take" has one answer, `KVCacheManager.num_blocks_needed`,
which counts sharing (n > 1, beam search), prefix-cache hits and copy-on-write exactly once; the
scheduler's admission, scheduling, swap-in and readmission and the engine's submit check all ask it
(a lone running request, every decode step, takes a shortcut that the tests hold to the same answer).

Prefix caching (the hash-chain design of vLLM's automatic prefix caching): a full block is named by
a hash chained over (parent block's hash, its token ids, extra keys); the first block's extra keys
hold the request's ``cache_salt`` so tenants with different salts never share. A request admitted
with a cached prefix takes those blocks (reference count up) and computes only the rest. Only full
blocks are cached, and at least one token is always left to compute, so the step has a token to
sample from. SHA-256 by default: cache contents are secret in a multi-tenant server and a
collision would serve one tenant's KV to another.
"""

from __future__ import annotations

import hashlib

import msgspec

from pagedkv.scheduler.block_pool import Block, BlockPool
from pagedkv.scheduler.request import Request, RequestStatus
from pagedkv.scheduler.swap import SwapSpace

_encode = msgspec.msgpack.Encoder().encode


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxhash(data: bytes) -> bytes:
    import xxhash  # optional dependency, only for --prefix-caching-hash-algo xxhash

    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS = {"sha256": _sha256, "xxhash": _xxhash}


def hash_block(hash_fn, parent: bytes | None, token_ids: list[int], extra: tuple = ()) -> bytes:
    """The prefix-cache name of one full block: hash_fn(msgpack((parent hash, token ids, extra keys)))."""
    return hash_fn(_encode((parent, token_ids, extra)))


class KVCacheManager:
    """Allocates and frees blocks for requests; owns the device block pool, the prefix cache and the host pool.

    block_size in tokens; num_gpu_blocks and num_cpu_blocks (the host swap pool, 0: no swap) in
    blocks. `allocate_slots` returns None when the pool cannot hold the step's tokens; callers
    ask `num_blocks_needed` first. Raises ValueError for an unknown hash algo.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256", num_cpu_blocks: int = 0):
        if hash_algo not in HASH_FUNCTIONS:
            raise ValueError(f"prefix caching hash algo must be one of {sorted(HASH_FUNCTIONS)}, got {hash_algo!r}")
        self.block_size = block_size
        self.pool = BlockPool(num_gpu_blocks)
        self.swap = SwapSpace(num_cpu_blocks, self.pool)
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = HASH_FUNCTIONS[hash_algo]
        self._pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next plan
        self._replaced: dict[str, list[tuple[int, int]]] = {}  # request id -> (table index, new block)

    @property
    def num_gpu_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free_blocks

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.swap.num_free_cpu_blocks

    @property
    def cpu_usage(self) -> float:
        return self.swap.usage

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` token slots: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    # ---- the one block count -------------------------------------------------------------------

    def num_blocks_needed(self, steps: list[tuple[Request, int]], *, empty_pool: bool = False) -> int:
        """Free device blocks it takes to compute ``n`` more tokens of each ``(request, n)`` together.

        Each request is counted from where it stands:
        - running (it holds device blocks): the blocks its table grows by;
        - swapped (its blocks are on the host): its host blocks coming back, each distinct block
          once however many tables share it, plus the blocks its table grows by;
        - waiting (no blocks): its prefix-cache hits (a hit on a free cached block takes it out of
          the free queue, counted once however many requests hit it) and the blocks after them.
          Several waiting members of one group (n > 1, beam search) share the full blocks before
          their fork point, as forked siblings do.
        Copy-on-write: a block shared by k tables and written by w of ``steps`` costs min(w, k - 1)
        copies (the last writer keeps the block), never one per writer.

        empty_pool: count the requests as if the pool were empty and the prefix cache cold (the
        submit check: a request that needs more than ``num_gpu_blocks`` this way can never run).
        """
        bs = self.block_size
        if len(steps) == 1 and not empty_pool and steps[0][0].status is RequestStatus.RUNNING:
            return self._running_need(*steps[0])  # the hot path: a lone running sequence, every step
        need = 0
        taken_hits: set[int] = set()  # free cached blocks a hit takes, each once
        host_blocks: set[int] = set()  # host blocks a swap-in brings back, each once
        writers: dict[tuple[str, int], list[int]] = {}  # (pool, shared block) -> [writers, ref count]
        forked: dict[int, int] = {}  # id(group) -> blocks the first waiting member shares with its siblings
        for req, n in steps:
            status = req.status
            if status is RequestStatus.RUNNING and not empty_pool:  # with its group (n > 1, beam search)
                table, pool, kind = req.block_table, self.pool, "device"
            elif status is RequestStatus.SWAPPED and not empty_pool:
                table, pool, kind = self.swap.host_tables[req.request_id], self.swap.host, "host"
                host_blocks.update(table)
            else:  # waiting: blocks from scratch, after its prefix hits
                hits = [] if empty_pool else self.find_cached_prefix(req)
                taken_hits.update(b.block_id for b in hits if b.ref_cnt == 0)
                num_shared = len(hits)
                if len(req.group) > 1:
                    key = id(req.group)
                    if key in forked:
                        num_shared = max(num_shared, forked[key])
                    else:
                        forked[key] = req.fork_point // bs
                need += max(-(-(len(hits) * bs + n) // bs) - num_shared, 0)
                continue
            computed = req.num_computed_tokens
            grow = -(-(computed + n) // bs) - len(table)
            if grow > 0:
                need += grow
            index = computed // bs
            if n and index < len(table):
                block = pool.blocks[table[index]]
                if block.ref_cnt > 1:
                    w = writers.setdefault((kind, block.block_id), [0, block.ref_cnt])
                    w[0] += 1
        need += len(taken_hits) + len(host_blocks)
        for w, ref_cnt in writers.values():
            need += min(w, ref_cnt - 1)
        return need

    def _running_need(self, req: Request, n: int) -> int:
        """`num_blocks_needed` of one running request alone: its table's growth, plus one block when
        its first new token lands in a shared block (copy-on-write). Must equal the general count, as
        tests/test_block_pool.py's state machine checks at every append."""
        grow = self.blocks_for(req.num_computed_tokens + n) - len(req.block_table)
        return max(grow, 0) + (self._shared_write_block(req, n) is not None)

    # ---- prefix caching ------------------------------------------------------------------------

    def _block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks (``request.block_hashes``), extended as its tokens fill blocks."""
        hashes, bs = request.block_hashes, self.block_size
        while (len(hashes) + 1) * bs <= request.num_tokens:
            i = len(hashes)
            extra = (request.cache_salt,) if i == 0 and request.cache_salt else ()
            hashes.append(hash_block(self._hash_fn, hashes[-1] if hashes else None,
                                     request.token_ids[i * bs:(i + 1) * bs], extra))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks matching the leading full blocks of a request with no blocks.

        Covers at most ``num_tokens - 1`` tokens, so one token is always left to compute, and a group
        leader with siblings still to fork (n > 1, beam search, readmitted after recompute) at most its
        fork point: the siblings fork there, before the tokens that differ between them. Empty when
        prefix caching is off or the request has computed tokens already. A request that asks for
        prompt logprobs gets no hit: a cached block carries K/V but no logits, so its whole prompt is
        computed (vLLM does the same); its full blocks are still cached for others.
        """
        if (not self.enable_prefix_caching or request.num_computed_tokens
                or request.sampling.prompt_logprobs is not None):
            return []
        end = request.fork_point if request.pending_forks else request.num_tokens - 1
        hits: list[Block] = []
        for h in self._block_hashes(request)[: end // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[Block] | None = None) -> list[int] | None:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens.

        cached_blocks: a prefix found by `find_cached_prefix` for a request being admitted; they
        join its table (reference counts up) and advance num_computed_tokens.
        A first write into a shared block copies it first (copy-on-write): the copy is queued for
        `take_pending_copies` and the table change for `take_replaced_blocks`.
        Returns the ids of the blocks appended to the table (excluding cached ones), or None — with
        no state changed — when too few blocks are free.
        """
        if not cached_blocks and self._room_in_table(request, num_new_tokens):  # most decode steps
            if self.enable_prefix_caching:
                self._cache_full_blocks(request, request.num_computed_tokens + num_new_tokens)
            return []
        cached_blocks = cached_blocks or []
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_required = (self.blocks_for(num_computed + num_new_tokens)
                        - len(request.block_table) - len(cached_blocks))
        cow = self._shared_write_block(request, num_new_tokens)
        # cached blocks that sit in the free queue stop being free once touched
        num_free = self.pool.num_free_blocks - sum(1 for b in cached_blocks if b.ref_cnt == 0)
        if max(num_required, 0) + (cow is not None) > num_free:
            return None
        if cached_blocks:
            self.pool.touch(cached_blocks)
            request.block_table.extend(b.block_id for b in cached_blocks)
            request.num_computed_tokens = num_computed
        if cow is not None:  # copy-on-write: this request's next token lands in a shared block
            index, src = cow
            dst = self.pool.allocate(1)[0]
            self.pool.free([src])  # still referenced by the others
            request.block_table[index] = dst.block_id
            self._pending_copies.append((src.block_id, dst.block_id))
            self._replaced.setdefault(request.request_id, []).append((index, dst.block_id))
        new_ids = [b.block_id for b in self.pool.allocate(max(num_required, 0))]
        request.block_table.extend(new_ids)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_ids

    def _room_in_table(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's table already holds ``num_new_tokens`` more tokens, in blocks it
        alone references: no block to allocate, none to copy. `allocate_slots` then returns early; the
        state it leaves is checked against its general path's in tests/test_block_pool.py."""
        return (self.blocks_for(request.num_computed_tokens + num_new_tokens) <= len(request.block_table)
                and self._shared_write_block(request, num_new_tokens) is None)

    def _shared_write_block(self, request: Request, num_new_tokens: int) -> tuple[int, Block] | None:
        """(table index, block) when the first new token would be written into a shared block."""
        index = request.num_computed_tokens // self.block_size
        if num_new_tokens == 0 or index >= len(request.block_table):
            return None
        block = self.pool.blocks[request.block_table[index]]
        return (index, block) if block.ref_cnt > 1 else None

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's block table and progress, sharing every block (ref count up).

        The first write into a shared, partly filled block copies it (`allocate_slots`), so the
        fork costs no copy until then — and only the block at the fork point is ever copied.
        """
        assert not child.block_table, "fork target must own no blocks"
        self.pool.touch([self.pool.blocks[b] for b in parent.block_table])
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) pairs queued since the last call; the worker runs them first."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_replaced_blocks(self, request: Request) -> list[tuple[int, int]]:
        """The (table index, new block) changes copy-on-write made to the request's table since the last call."""
        return self._replaced.pop(request.request_id, [])

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Name every block that will be full once ``num_tokens`` tokens are computed."""
        if num_tokens // self.block_size <= request.num_named_blocks:
            return  # no block fills: most decode steps
        hashes = self._block_hashes(request)
        end = min(num_tokens // self.block_size, len(hashes))
        for i in range(request.num_named_blocks, end):  # only blocks not yet named
            block = self.pool.blocks[request.block_table[i]]
            if block.block_hash is None:
                self.pool.cache(block, hashes[i])
        request.num_named_blocks = max(end, request.num_named_blocks)

    def free(self, request: Request) -> None:
        """Give back every device block of the request (tail first, for LRU-ish eviction order)."""
        self.pool.free([self.pool.blocks[b] for b in reversed(request.block_table)])
        self._replaced.pop(request.request_id, None)
        request.num_named_blocks = 0
        request.block_table = []
        request.num_computed_tokens = 0

    # ---- the host pool (swap preemption) -------------------------------------------------------

    def can_swap_out(self, group: list[Request]) -> bool:
        """Whether the host pool has a free block for every distinct device block of ``group``."""
        return self.swap.can_swap_out(group)

    def swap_out(self, group: list[Request]) -> list[tuple[int, int]]:
        """Move every block of ``group`` to the host pool; (device_block, host_block) pairs for the worker."""
        for req in group:  # the worker gets the whole table again at swap-in
            self._replaced.pop(req.request_id, None)
            req.num_named_blocks = 0  # its table empties: the blocks it gets back (swap-in or recompute) are named anew
        return self.swap.swap_out(group)

    def swap_in(self, group: list[Request]) -> list[tuple[int, int]]:
        """Bring every block of ``group`` back from the host pool; (host_block, device_block) pairs."""
        return self.swap.swap_in(group)

    def host_block_table(self, request: Request) -> list[int]:
        """The host blocks holding a swapped-out request's KV, in logical order ([] if none)."""
        return list(self.swap.host_tables.get(request.request_id, []))

    def free_host(self, request: Request) -> None:
        """Drop a swapped request's host blocks without bringing them back (abort, readmission by recompute)."""
        self.swap.free(request)

    def snapshot(self) -> dict:
        """JSON-ready view of both pools: sizes, usage, the ref count of every referenced device block,
        and the free device blocks that still hold a cached prefix (evictable, least recently used first)."""
        return {
            "block_size": self.block_size,
            "num_gpu_blocks": self.pool.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_free_blocks": self.pool.num_cached_free_blocks,
            "usage": self.pool.usage,
            "prefix_caching": self.enable_prefix_caching,
            "block_ref_counts": {str(b.block_id): b.ref_cnt for b in self.pool.blocks if b.ref_cnt > 0},
            "cached_free_block_ids": sorted(b.block_id for b in self.pool.cached.values() if b.ref_cnt == 0),
            "num_cpu_blocks": self.swap.num_cpu_blocks,
            "num_free_cpu_blocks": self.swap.num_free_cpu_blocks,
            "cpu_usage": self.swap.usage,
        }
