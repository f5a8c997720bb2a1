"""The block pool and KV cache manager keep their invariants under any sequence of operations."""

import copy

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.common.sampling_params import SamplingParams
from pagedkv.scheduler.block_pool import BlockPool
from pagedkv.scheduler.kv_cache_manager import KVCacheManager
from pagedkv.scheduler.request import Request, RequestStatus

NUM_BLOCKS = 12
BLOCK_SIZE = 4


def test_free_queue_hands_out_blocks_in_order_and_takes_them_back_at_the_tail():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.num_free_blocks == 1
    pool.free([a[2], a[0]])
    assert [b.block_id for b in pool.free_queue] == [3, 2, 0]
    assert [b.block_id for b in pool.allocate(3)] == [3, 2, 0]
    pool.check_invariants([[1, 3, 2, 0]])


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    try:
        pool.allocate(2)
    except ValueError as e:
        assert "2 blocks, 1 free" in str(e)
    else:
        raise AssertionError("expected ValueError")
    assert pool.num_free_blocks == 1


def test_a_new_block_only_when_the_last_is_full():
    kv = KVCacheManager(8, block_size=4, enable_prefix_caching=False)
    req = Request("r", [1, 2, 3], SamplingParams())
    assert kv.allocate_slots(req, 3) == [0]
    req.num_computed_tokens = 3
    req.token_ids.append(9)
    assert kv.allocate_slots(req, 1) == []  # slot 3 of block 0 is still free
    req.num_computed_tokens = 4
    req.token_ids.append(9)
    assert kv.allocate_slots(req, 1) == [1]
    assert req.block_table == [0, 1]
    kv.free(req)
    assert kv.num_free_blocks == 8 and req.block_table == []


def test_allocation_failure_changes_no_state():
    kv = KVCacheManager(2, block_size=4)
    req = Request("r", list(range(9)), SamplingParams())
    assert kv.allocate_slots(req, 9) is None
    assert req.block_table == [] and kv.num_free_blocks == 2


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(8, block_size=4)
    a = Request("a", list(range(8)), SamplingParams())
    kv.allocate_slots(a, 8)
    b = Request("b", list(range(8)), SamplingParams())
    hits = kv.find_cached_prefix(b)
    assert [h.block_id for h in hits] == [0]  # 8 tokens: at most 7 cached -> one full block
    assert kv.allocate_slots(b, 4, hits) == [2]
    assert b.block_table == [0, 2] and b.num_computed_tokens == 4
    assert kv.pool.blocks[0].ref_cnt == 2
    kv.pool.check_invariants([a.block_table, b.block_table])


def test_cache_salt_separates_tenants():
    kv = KVCacheManager(8, block_size=4)
    a = Request("a", list(range(9)), SamplingParams(), cache_salt="tenant-a")
    kv.allocate_slots(a, 9)
    other = Request("b", list(range(9)), SamplingParams(), cache_salt="tenant-b")
    same = Request("c", list(range(9)), SamplingParams(), cache_salt="tenant-a")
    assert kv.find_cached_prefix(other) == []
    assert [b.block_id for b in kv.find_cached_prefix(same)] == [0, 1]


def test_freed_cached_blocks_are_evicted_least_recently_used_first():
    kv = KVCacheManager(4, block_size=2)
    a = Request("a", [1, 2, 3, 4], SamplingParams())
    kv.allocate_slots(a, 4)  # blocks 0, 1 cached
    kv.free(a)  # tail first: queue 2, 3, 1, 0
    assert kv.pool.num_cached_free_blocks == 2
    b = Request("b", [7, 7, 7, 7, 7, 7], SamplingParams())
    assert kv.allocate_slots(b, 6) == [2, 3, 1]  # block 1 (a's later block) evicted first
    assert kv.pool.num_evictions == 1
    assert kv.find_cached_prefix(Request("c", [1, 2, 3, 4, 5], SamplingParams()))[0].block_id == 0


class KVCacheMachine(RuleBasedStateMachine):
    """Random allocate / fork / append (with copy-on-write) / preempt / free / evict sequences.

    Checked after every step: each block's ref count equals the number of block tables holding it,
    free + referenced = total, nothing is both free and referenced, every cached hash maps back to
    its block, and every copy-on-write went into a block owned by exactly one table.
    """

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.live: dict[str, Request] = {}
        self.n = 0

    def _new(self, tokens):
        req = Request(f"r{self.n}", tokens, SamplingParams())
        self.n += 1
        return req

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20))
    def admit(self, prompt):
        req = self._new(prompt)
        hits = self.kv.find_cached_prefix(req)
        todo = req.num_tokens - len(hits) * BLOCK_SIZE
        if self.kv.allocate_slots(req, todo, hits) is not None:
            req.num_computed_tokens = req.num_tokens
            req.status = RequestStatus.RUNNING
            self.live[req.request_id] = req
        else:
            assert req.block_table == []

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        child = self._new(parent.prompt_token_ids)
        child.token_ids = list(parent.token_ids)
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        assert child.block_table == parent.block_table
        self.live[child.request_id] = child

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 3), max_size=6))
    def append(self, data, tokens):
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.token_ids.extend(tokens)
        n, before = len(tokens), list(req.block_table)
        # A lone running request's count (the scheduler's fast path) equals the general count (another
        # request with no token to compute adds nothing), and allocation takes exactly that many blocks.
        need = self.kv.num_blocks_needed([(req, n)])
        if (other := next((r for r in self.live.values() if r is not req), None)) is not None:
            assert need == self.kv.num_blocks_needed([(req, n), (other, 0)])
        # allocate_slots' early return (room in blocks the request alone holds) leaves the state that
        # its general path leaves, run on a copy with the early return off
        kv, twin = copy.deepcopy((self.kv, req))
        kv._room_in_table = lambda *_: False
        expected = kv.allocate_slots(twin, n)
        free = self.kv.num_free_blocks
        new_blocks = self.kv.allocate_slots(req, n)
        assert new_blocks == expected and req.block_table == twin.block_table
        assert req.num_named_blocks == twin.num_named_blocks
        assert [(b.ref_cnt, b.block_hash) for b in self.kv.pool.blocks] == [(b.ref_cnt, b.block_hash) for b in kv.pool.blocks]
        copies = self.kv.take_pending_copies()
        assert copies == kv.take_pending_copies()
        if new_blocks is not None:
            assert free - self.kv.num_free_blocks == need
            req.num_computed_tokens += n
            assert len(req.block_table) == -(-req.num_tokens // BLOCK_SIZE)
            if n:
                written = self.kv.pool.blocks[req.block_table[(req.num_tokens - n) // BLOCK_SIZE]]
                assert written.ref_cnt == 1, "a write into a shared block without copy-on-write"
            for src, dst in copies:
                assert src in before and src not in req.block_table and dst in req.block_table
            self.kv.take_replaced_blocks(req)
        else:
            assert need > free
            del req.token_ids[len(req.token_ids) - n:]
            assert req.block_table == before and not copies

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_or_preempt(self, data):
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(req)

    @invariant()
    def pool_is_consistent(self):
        self.kv.pool.check_invariants([r.block_table for r in self.live.values()])


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_fork_shares_every_block_and_the_first_write_copies_only_the_partial_one():
    kv = KVCacheManager(8, block_size=4)
    parent = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams())
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = Request("c", [1, 2, 3, 4, 5, 6], SamplingParams())
    kv.fork(parent, child)
    assert [kv.pool.blocks[b].ref_cnt for b in parent.block_table] == [2, 2]
    child.token_ids.append(9)
    assert kv.allocate_slots(child, 1) == []
    assert child.block_table == [0, 2] and kv.take_pending_copies() == [(1, 2)]
    assert kv.take_replaced_blocks(child) == [(1, 2)] and kv.take_replaced_blocks(child) == []
    parent.token_ids.append(7)
    assert kv.allocate_slots(parent, 1) == [] and kv.take_pending_copies() == []  # sole owner now: no copy
    kv.pool.check_invariants([parent.block_table, child.block_table])


def test_xxhash_names_blocks_too_and_hits_the_same_prefix():
    kv = KVCacheManager(8, block_size=4, hash_algo="xxhash")
    a = Request("a", list(range(9)), SamplingParams())
    kv.allocate_slots(a, 9)
    assert [b.block_id for b in kv.find_cached_prefix(Request("b", list(range(9)), SamplingParams()))] == [0, 1]
    assert all(len(h) == 16 for h in kv.pool.cached)  # xxh3-128 digests
