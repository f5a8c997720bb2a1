"""Swap accounting: the host block pool and which host blocks hold each swapped-out request.

Swap preemption (PagedAttention, Kwon et al., SOSP 2023, §4.5) moves a victim's KV blocks to a
pool in host memory and brings them back before it runs again, so it resumes without recompute.
The control plane accounts for host blocks exactly as for device blocks: a second `BlockPool` of
``num_cpu_blocks`` (no prefix caching: a host block is only ever a copy in transit). All blocks of a
request — and of its sibling group (n > 1, beam search) — move together, never a part, and a block
shared by several siblings moves once and stays shared on the other side (its host reference count
is the number of tables holding it). The worker performs the copies the returned pairs name.
"""

from __future__ import annotations

from pagedkv.scheduler.block_pool import BlockPool
from pagedkv.scheduler.request import Request


class SwapSpace:
    """The host pool of ``num_cpu_blocks`` blocks and the host block tables of swapped requests.

    ``device`` is the device `BlockPool` the blocks move out of and back into. ``num_cpu_blocks``
    may be 0 (``--swap-space 0``): then nothing ever fits and every victim is recomputed.
    """

    def __init__(self, num_cpu_blocks: int, device: BlockPool):
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self.host = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self.host_tables: dict[str, list[int]] = {}  # request id -> host block ids, logical order
        self.num_blocks_swapped_out = 0  # device blocks copied to the host, ever
        self.num_blocks_swapped_in = 0

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.host.num_free_blocks if self.host else 0

    @property
    def usage(self) -> float:
        """Fraction of host blocks holding swapped-out KV (0 when there is no host pool)."""
        return self.host.usage if self.host else 0.0

    @staticmethod
    def distinct(tables: list[list[int]]) -> list[int]:
        """The block ids of several tables, each once, in first-seen order (shared blocks move once)."""
        return list(dict.fromkeys(b for table in tables for b in table))

    def can_swap_out(self, requests: list[Request]) -> bool:
        """Whether the host pool has a free block for every distinct device block of ``requests``."""
        return len(self.distinct([r.block_table for r in requests])) <= self.num_free_cpu_blocks

    def num_blocks_to_swap_in(self, requests: list[Request]) -> int:
        """Device blocks a swap-in of ``requests`` takes (their distinct host blocks)."""
        return len(self.distinct([self.host_tables[r.request_id] for r in requests]))

    def swap_out(self, requests: list[Request]) -> list[tuple[int, int]]:
        """Move every block of ``requests`` to the host pool; returns (device_block, host_block) pairs.

        Each request's device blocks are freed (its ``block_table`` becomes empty, its
        ``num_computed_tokens`` is kept: that KV now lives on the host).
        Raises ValueError when the host pool lacks room (check `can_swap_out` first); nothing changes then.
        """
        if not self.can_swap_out(requests):
            raise ValueError(f"host pool has {self.num_free_cpu_blocks} free blocks, too few to swap out "
                             f"{[r.request_id for r in requests]}")
        device_ids = self.distinct([r.block_table for r in requests])
        host_of = dict(zip(device_ids, (b.block_id for b in self.host.allocate(len(device_ids)))))
        for req in requests:
            table = [host_of[b] for b in req.block_table]
            self.host.touch([self.host.blocks[h] for h in table])  # one reference per table entry
            self.host_tables[req.request_id] = table
            self.device.free([self.device.blocks[b] for b in reversed(req.block_table)])
            req.block_table = []
        self.host.free([self.host.blocks[h] for h in host_of.values()])  # drop allocate's own reference
        self.num_blocks_swapped_out += len(device_ids)
        return list(host_of.items())

    def swap_in(self, requests: list[Request]) -> list[tuple[int, int]]:
        """Bring every block of ``requests`` back to the device; returns (host_block, device_block) pairs.

        Each request gets a fresh device block table (same sharing as before the swap-out) and its
        host blocks are freed. Raises ValueError when the device pool lacks room (the scheduler
        checks `num_blocks_to_swap_in` first); nothing changes then.
        """
        host_ids = self.distinct([self.host_tables[r.request_id] for r in requests])
        if len(host_ids) > self.device.num_free_blocks:
            raise ValueError(f"device pool has {self.device.num_free_blocks} free blocks, too few to swap in "
                             f"{len(host_ids)} blocks of {[r.request_id for r in requests]}")
        device_of = dict(zip(host_ids, (b.block_id for b in self.device.allocate(len(host_ids)))))
        for req in requests:
            host_table = self.host_tables.pop(req.request_id)
            req.block_table = [device_of[h] for h in host_table]
            self.device.touch([self.device.blocks[b] for b in req.block_table])
            self.host.free([self.host.blocks[h] for h in reversed(host_table)])
        self.device.free([self.device.blocks[d] for d in device_of.values()])  # drop allocate's reference
        self.num_blocks_swapped_in += len(host_ids)
        return list(device_of.items())

    def free(self, request: Request) -> None:
        """Drop a swapped request's host blocks without bringing them back (abort, failure)."""
        table = self.host_tables.pop(request.request_id, None)
        if table:
            self.host.free([self.host.blocks[h] for h in reversed(table)])

    def check_invariants(self) -> None:
        """Assert the host pool's reference counts match the host tables (tests call this)."""
        if self.host is not None:
            self.host.check_invariants(list(self.host_tables.values()))
