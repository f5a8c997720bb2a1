"""The block pool: physical KV blocks, their reference counts and the free-block queue.

A block's ``ref_cnt`` is the number of block tables pointing at it, the single source of truth:
a block is in the free queue exactly when its count is 0. Free blocks are handed out from the
head of the queue and returned to the tail, so a freed block that still holds a cached prefix
(``block_hash`` set) stays reusable until it reaches the head and is evicted: least recently
used first. The queue is a doubly linked list through the blocks themselves, so taking a cached
block out of the middle on a prefix-cache hit is O(1) (the structure of vLLM V1's block pool).
"""

from __future__ import annotations


class Block:
    """One physical block of ``block_size`` token slots in the device KV pool.

    block_hash: the prefix-cache hash of its full contents, or None (partial or uncached).
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) popleft, append and remove-from-the-middle."""

    def __init__(self, blocks: list[Block]):
        self.num_free_blocks = len(blocks)
        self._head = Block(-1)  # sentinels keep the link logic branch-free
        self._tail = Block(-1)
        prev = self._head
        for block in blocks:
            prev.next, block.prev = block, prev
            prev = block
        prev.next, self._tail.prev = self._tail, prev

    def popleft(self) -> Block:
        """Remove and return the least recently freed block. Raises IndexError when empty."""
        block = self._head.next
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def append(self, block: Block) -> None:
        last = self._tail.prev
        last.next, block.prev = block, last
        block.next, self._tail.prev = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next
        while block is not self._tail:
            yield block
            block = block.next


class BlockPool:
    """``num_blocks`` physical blocks with reference counts, a free queue and a prefix-cache index.

    Raises ValueError from `allocate` when asked for more blocks than are free; callers check
    `num_free_blocks` first (allocation failure is the scheduler's signal to preempt).
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}  # block_hash -> the block holding that content
        self.num_cached_free_blocks = 0  # free blocks still holding a cached prefix (a gauge, read every step)
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0, including cached ones that can still be hit."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live block tables (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue (ref_cnt 1 each), evicting their cached hashes."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:  # evict: its content is about to be overwritten
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_cached_free_blocks -= 1
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Add one reference to each block (sharing or a prefix hit); a free block leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free_blocks -= block.block_hash is not None
            block.ref_cnt += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference from each block; blocks reaching 0 go to the tail of the free queue.

        Pass a request's blocks tail first, so its later (less shared) blocks are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise AssertionError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                self.num_cached_free_blocks += block.block_hash is not None

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def cache(self, block: Block, block_hash: bytes) -> None:
        """Record that ``block`` is full and holds the content named by ``block_hash``."""
        if block.block_hash is not None:
            return
        first = self.cached.get(block_hash)
        if first is not None:
            if first.ref_cnt:
                return  # an identical live block is cached: keep the first
            # an identical copy sits free (a request swapped back in, or one that skipped the cache):
            # name the live block instead, or the free copy's eviction loses a prefix still held
            first.block_hash = None
            self.num_cached_free_blocks -= 1
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def check_invariants(self, block_tables: list[list[int]]) -> None:
        """Assert the pool's invariants against the live block tables (tests call this).

        Each block's ref_cnt equals the number of block-table entries holding it; free blocks are
        exactly those with ref_cnt 0; free + referenced = total; every hashed block maps back.
        Raises AssertionError naming the first violation.
        """
        counts = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                counts[b] += 1
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks, "free queue corrupt"
        free = set(free_ids)
        for block in self.blocks:
            assert block.ref_cnt == counts[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but {counts[block.block_id]} tables hold it")
            assert (block.block_id in free) == (block.ref_cnt == 0), f"block {block.block_id} free and referenced"
        referenced = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert len(free) + referenced == self.num_blocks, "free + referenced != total"
        for h, block in self.cached.items():
            assert block.block_hash == h, f"cached hash of block {block.block_id} does not map back"
        assert self.num_cached_free_blocks == sum(1 for b in self.cached.values() if b.ref_cnt == 0), (
            "cached free block count drifted")
