"""The KV cache manager: block tables on top of the block pool, with prefix caching.

Each request owns one block table (``request.block_table``, physical block ids in logical order).
A new block is taken only when the last one is full (PagedAttention, Kwon et al., SOSP 2023, §4.2),
and every block goes back when the request finishes, is aborted, fails or is preempted.

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
from pagedkv.scheduler.request import Request

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
    """Allocates and frees blocks for requests; owns the device block pool and the prefix cache.

    block_size in tokens; num_gpu_blocks in blocks. `allocate_slots` returns None when the pool
    cannot hold the step's tokens: the scheduler's signal to preempt or stop admitting.
    """

    def __init__(self, num_gpu_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256"):
        if hash_algo not in HASH_FUNCTIONS:
            raise ValueError(f"prefix caching hash algo must be one of {sorted(HASH_FUNCTIONS)}, got {hash_algo!r}")
        self.block_size = block_size
        self.pool = BlockPool(num_gpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = HASH_FUNCTIONS[hash_algo]
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks
        self._num_named: dict[str, int] = {}  # request id -> leading blocks already offered to the cache
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the next plan
        self.replaced_blocks: dict[str, list[tuple[int, int]]] = {}  # request id -> (index, new block)

    @property
    def num_gpu_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended lazily as its tokens fill blocks."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while (len(hashes) + 1) * bs <= request.num_tokens:
            i = len(hashes)
            extra = (request.cache_salt,) if i == 0 and request.cache_salt else ()
            hashes.append(hash_block(self._hash_fn, hashes[-1] if hashes else None,
                                     request.token_ids[i * bs:(i + 1) * bs], extra))
        return hashes

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks matching the request's leading full blocks.

        Covers at most ``num_tokens - 1`` tokens, so one token is always left to compute. A request
        that asks for prompt logprobs gets no hit: a cached block carries K/V but no logits, so its
        whole prompt is computed (vLLM does the same); its full blocks are still cached for others.
        """
        if not self.enable_prefix_caching or request.sampling.prompt_logprobs is not None:
            return []
        hits: list[Block] = []
        for h in self._block_hashes(request)[: (request.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[Block] | None = None) -> list[int] | None:
        """Grow the request's block table to hold ``num_new_tokens`` more tokens.

        cached_blocks: a prefix found by `find_cached_prefix` for a request being admitted; they
        join its table (reference counts up) and advance num_computed_tokens.
        A first write into a shared block copies it first (copy-on-write): the copy is queued in
        ``pending_copies`` and the table change in ``replaced_blocks``.
        Returns the ids of the blocks appended to the table (excluding cached ones), or None — with
        no state changed — when too few blocks are free.
        """
        cached_blocks = cached_blocks or []
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_required = (self.blocks_needed(num_computed + num_new_tokens)
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
            self.pending_copies.append((src.block_id, dst.block_id))
            self.replaced_blocks.setdefault(request.request_id, []).append((index, dst.block_id))
        new_ids = [b.block_id for b in self.pool.allocate(max(num_required, 0))]
        request.block_table.extend(new_ids)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, num_computed + num_new_tokens)
        return new_ids

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks `allocate_slots` would take for a running request (new blocks + a copy)."""
        num_required = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        return max(num_required, 0) + (self._shared_write_block(request, num_new_tokens) is not None)

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
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Name every block that will be full once ``num_tokens`` tokens are computed."""
        hashes = self._block_hashes(request)
        end = min(num_tokens // self.block_size, len(hashes))
        for i in range(self._num_named.get(request.request_id, 0), end):  # only blocks not yet named
            block = self.pool.blocks[request.block_table[i]]
            if block.block_hash is None:
                self.pool.cache(block, hashes[i])
        self._num_named[request.request_id] = max(end, self._num_named.get(request.request_id, 0))

    def free(self, request: Request) -> None:
        """Give back every block of the request (tail first, for LRU-ish eviction order)."""
        self.pool.free([self.pool.blocks[b] for b in reversed(request.block_table)])
        self.replaced_blocks.pop(request.request_id, None)
        self._num_named.pop(request.request_id, None)
        request.block_table = []
        request.num_computed_tokens = 0

    def forget(self, request: Request) -> None:
        """Drop per-request bookkeeping once the request is finished for good."""
        self._hashes.pop(request.request_id, None)
        self._num_named.pop(request.request_id, None)

    def snapshot(self) -> dict:
        """JSON-ready view of the pool: sizes, usage, and the ref count of every referenced block."""
        return {
            "block_size": self.block_size,
            "num_gpu_blocks": self.pool.num_blocks,
            "num_free_blocks": self.pool.num_free_blocks,
            "num_cached_free_blocks": self.pool.num_cached_free_blocks,
            "usage": self.pool.usage,
            "prefix_caching": self.enable_prefix_caching,
            "block_ref_counts": {str(b.block_id): b.ref_cnt for b in self.pool.blocks if b.ref_cnt > 0},
        }
