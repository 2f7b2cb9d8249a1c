"""RadixCache over a BlockPool: exact block ids, reference counts, locks, LRU eviction, random operations."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from forklm.cache.block_pool import BlockPool
from forklm.cache.radix_cache import RadixCache


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks=16, block_size=2):
    clock = Clock()
    pool = BlockPool(num_blocks, block_size)
    return pool, RadixCache(pool, clock=clock), clock


def finish(pool, cache, tokens):
    """A sequence reused the cached prefix of `tokens`, computed the rest, inserted and finished."""
    m = cache.match_prefix(tokens, max_tokens=len(tokens))
    pool.incref(m.blocks)
    blocks = m.blocks + pool.allocate(len(tokens) // pool.block_size - len(m.blocks))
    assert cache.insert(tokens, blocks) == []
    pool.decref(blocks)
    return blocks


def test_insert_then_match_full_and_partial():
    pool, cache, _ = make()
    blocks = pool.allocate(3)  # [0, 1, 2]; the 7th token's partial block is not cached
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], blocks) == []
    assert [pool.refcount(b) for b in blocks] == [2, 2, 2]
    assert cache.num_cached_blocks == 3 and cache.num_evictable_blocks == 3
    cache.check_integrity({"seq": blocks})

    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert (m.num_tokens, m.blocks) == (6, [0, 1, 2])
    m = cache.match_prefix([1, 2, 3, 4, 9, 9, 9])  # diverges at a block boundary
    assert (m.num_tokens, m.blocks) == (4, [0, 1])
    m = cache.match_prefix([1, 2, 3, 9, 5, 6, 7])  # diverges inside the second block
    assert (m.num_tokens, m.blocks) == (2, [0])
    m = cache.match_prefix([2, 1, 3, 4])
    assert (m.num_tokens, m.blocks, m.node) == (0, [], cache._root)
    assert [pool.refcount(b) for b in blocks] == [2, 2, 2]  # matching takes no references
    cache.check_integrity({"seq": blocks})


def test_match_recomputes_the_last_prompt_token_by_default():
    pool, cache, _ = make()
    finish(pool, cache, [1, 2, 3, 4])
    assert cache.match_prefix([1, 2, 3, 4]).blocks == [0]  # at most 3 tokens: one block
    assert cache.match_prefix([1, 2, 3, 4, 5]).blocks == [0, 1]
    assert cache.match_prefix([1, 2, 3, 4], max_tokens=4).blocks == [0, 1]
    assert cache.match_prefix([1, 2, 3, 4], max_tokens=100).blocks == [0, 1]
    assert cache.match_prefix([1, 2, 3, 4], max_tokens=1).blocks == []
    assert cache.match_prefix([]).num_tokens == 0
    with pytest.raises(ValueError, match="max_tokens"):
        cache.match_prefix([1, 2], max_tokens=-1)


def test_match_splits_a_node_and_handles_stay_valid():
    pool, cache, _ = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6])  # one node, blocks [0, 1, 2]
    whole = cache.match_prefix([1, 2, 3, 4, 5, 6], max_tokens=6)
    cache.lock(whole.node)
    assert cache.num_evictable_blocks == 0
    head = cache.match_prefix([1, 2, 3, 4, 7, 7], max_tokens=6)  # splits [0, 1] | [2]
    assert head.blocks == [0, 1] and head.node is whole.node.parent
    assert head.node.lock_ref == 1  # the new parent inherits the lock
    cache.check_integrity({})
    # Branch off the split point, then unlock the original handle.
    assert finish(pool, cache, [1, 2, 3, 4, 8, 8]) == [0, 1, 3]
    assert cache.match_prefix([1, 2, 3, 4, 8, 8], max_tokens=6).blocks == [0, 1, 3]
    cache.unlock(whole.node)
    assert cache.num_evictable_blocks == 4
    cache.check_integrity({})
    assert cache.match_prefix([1, 2, 3, 4, 5, 6], max_tokens=6).blocks == [0, 1, 2]


def test_insert_returns_duplicates_and_existing_blocks_win():
    pool, cache, _ = make()
    a = pool.allocate(2)  # [0, 1]: request A's prompt [1, 2, 3, 4]
    b = pool.allocate(3)  # [2, 3, 4]: request B computed the same prompt concurrently, plus [5, 6]
    assert cache.insert([1, 2, 3, 4], a) == []
    assert cache.insert([1, 2, 3, 4, 5, 6], b) == [2, 3]
    assert [pool.refcount(x) for x in range(5)] == [2, 2, 1, 1, 2]  # 2, 3 not cached; 4 cached
    assert cache.match_prefix([1, 2, 3, 4, 5, 6], max_tokens=6).blocks == [0, 1, 4]
    cache.check_integrity({"A": a, "B": b})
    # B switches its block table to the cached blocks and lets its duplicates go.
    table = [0, 1, 4]
    pool.incref([0, 1])
    assert pool.decref([2, 3]) == 2
    cache.check_integrity({"A": a, "B": table})
    # Inserting blocks that came from a match is not a duplicate.
    assert cache.insert([1, 2, 3, 4, 5, 6, 7], table) == []
    pool.decref(a)
    pool.decref(table)
    assert pool.num_in_use == 0 and pool.num_cached == 3 and pool.num_free == 13
    cache.check_integrity({})


@pytest.mark.parametrize(
    "tokens, blocks, message",
    [
        ([1, 2, 3, 4, 5], [5], "fill 2 blocks"),
        ([1, 2, 3, 4], [5, 5], "repeated"),
        ([1, 2], [9], "free"),
        ([7, 7], [0], "cached under another prefix"),  # block 0 caches [1, 2]
        ([1, 2, 3, 4], [1, 5], "cached under another prefix"),  # block 1 caches [1, 2, 3, 4]
    ],
)
def test_insert_misuse_raises_and_changes_nothing(tokens, blocks, message):
    pool, cache, _ = make()
    finish(pool, cache, [1, 2, 3, 4])  # blocks 0, 1
    held = pool.allocate(4)  # 2, 3, 4, 5 held by a sequence
    with pytest.raises(ValueError, match=message):
        cache.insert(tokens, blocks)
    assert cache.num_cached_blocks == 2 and cache.all_blocks() == [0, 1]
    cache.check_integrity({"s": held})


def test_lock_prevents_eviction_and_is_counted():
    pool, cache, _ = make(num_blocks=6)
    finish(pool, cache, [1, 2, 3, 4])  # 0, 1
    finish(pool, cache, [5, 6])  # 2
    m = cache.match_prefix([1, 2, 3, 4, 0])
    cache.lock(m.node)
    cache.lock(m.node)  # a second request on the same path
    assert cache.num_evictable_blocks == 1
    assert cache.evict(10) == 1 and not pool.is_cached(2)
    assert cache.evict(10) == 0 and cache.all_blocks() == [0, 1]
    cache.unlock(m.node)
    assert cache.evict(10) == 0  # still locked once
    cache.unlock(m.node)
    assert cache.num_evictable_blocks == 2
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(m.node)
    assert cache.evict(10) == 2 and pool.num_free == 6
    with pytest.raises(ValueError, match="evicted"):
        cache.lock(m.node)
    cache.check_integrity({})


def test_lru_eviction_order_with_a_controlled_clock():
    pool, cache, clock = make()
    for t, tokens in enumerate([[1, 1], [2, 2], [3, 3]], start=1):
        clock.now = t
        finish(pool, cache, tokens)  # blocks 0, 1, 2 at times 1, 2, 3
    clock.now = 4
    cache.match_prefix([1, 1, 0])  # [1, 1] is now the most recent
    assert cache.evict(1) == 1 and sorted(cache.all_blocks()) == [0, 2]
    assert cache.evict(1) == 1 and cache.all_blocks() == [0]
    assert cache.evict(1) == 1 and cache.all_blocks() == []
    assert cache.num_cached_blocks == 0
    cache.check_integrity({})


def test_evicting_leaves_exposes_their_parent():
    pool, cache, clock = make()
    clock.now = 1
    finish(pool, cache, [1, 2, 3, 4])  # P: blocks 0, 1
    clock.now = 2
    finish(pool, cache, [1, 2, 3, 4, 5, 6])  # child C1: block 2
    clock.now = 3
    finish(pool, cache, [1, 2, 3, 4, 7, 8])  # child C2: block 3; P touched at 3 too
    clock.now = 4
    finish(pool, cache, [9, 9])  # W: block 4
    order = []
    for _ in range(5):
        before = set(cache.all_blocks())
        assert cache.evict(1) == 1
        order += sorted(before - set(cache.all_blocks()))
        cache.check_integrity({})
    # C1 (t=2), C2 (t=3), then P (t=3, a leaf only now) from its tail block, then W (t=4).
    assert order == [2, 3, 1, 0, 4]
    assert pool.allocate(16) == list(range(16))


def test_partial_eviction_keeps_the_prefix_and_overshoot_is_avoided():
    pool, cache, _ = make()
    finish(pool, cache, [1, 2, 3, 4, 5, 6])  # one node: 0, 1, 2
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 2, 3, 4, 5, 6], max_tokens=6).blocks == [0]
    assert pool.refcount(0) == 1 and pool.refcount(1) == pool.refcount(2) == 0
    assert cache.evict(0) == 0
    with pytest.raises(ValueError):
        cache.evict(-1)
    cache.check_integrity({})


def test_evicting_a_block_a_sequence_holds_does_not_free_it():
    pool, cache, _ = make()
    held = pool.allocate(2)
    cache.insert([1, 2, 3, 4], held)  # inserted but never locked: against the contract
    finish(pool, cache, [5, 5])  # block 2, cache only
    assert cache.num_evictable_blocks == 3
    assert cache.evict(3) == 1  # the whole tree leaves, only block 2 is freed
    assert cache.num_cached_blocks == 0 and [pool.refcount(b) for b in held] == [1, 1]
    cache.check_integrity({"s": held})


def test_requests_sharing_a_prompt_leave_no_references_behind():
    pool, cache, _ = make(num_blocks=12)
    prompt = [1, 2, 3, 4, 5]
    # First request: nothing cached; prefill 3 blocks, insert the 2 full ones, fork 3 samples.
    m = cache.match_prefix(prompt)
    cache.lock(m.node)
    own = pool.allocate(3)
    assert cache.insert(prompt, own[:2]) == []
    m2 = cache.match_prefix(prompt, max_tokens=len(prompt))
    cache.lock(m2.node)
    cache.unlock(m.node)
    tables = {f"r1.{i}": list(own) for i in range(3)}
    pool.incref(own * 2)  # the prompt blocks are shared by the samples, not copied
    tables.update({f"r1.{i}": tables[f"r1.{i}"] + pool.allocate(1) for i in range(3)})
    cache.check_integrity(tables)
    # Second request with the same prompt reuses two blocks.
    m3 = cache.match_prefix(prompt)
    assert m3.blocks == [0, 1]
    cache.lock(m3.node)
    pool.incref(m3.blocks)
    tables["r2"] = m3.blocks + pool.allocate(1)
    cache.check_integrity(tables)
    for name in list(tables):
        pool.decref(tables.pop(name))
    cache.unlock(m2.node)
    cache.unlock(m3.node)
    cache.check_integrity(tables)
    assert pool.num_in_use == 0 and pool.num_cached == 2 and cache.num_evictable_blocks == 2


# ----------------------------------------------------------------------------- random operations

BS, NUM_BLOCKS = 2, 10
token_lists = st.lists(st.integers(0, 1), max_size=9)  # small alphabet: many shared prefixes


class Seq:
    def __init__(self, tokens, blocks, node):
        self.tokens, self.blocks, self.node = list(tokens), list(blocks), node


class CacheMachine(RuleBasedStateMachine):
    """Engine-like use of the contract; `model` maps each cached full-block prefix to its block."""

    @initialize()
    def setup(self):
        self.pool = BlockPool(NUM_BLOCKS, BS)
        self.cache = RadixCache(self.pool)
        self.model: dict[tuple[int, ...], int] = {}
        self.seqs: dict[int, Seq] = {}
        self.locks: list = []  # extra locks without block references
        self.next_id = 0

    def expected(self, tokens, limit):
        blocks = []
        for k in range(1, limit // BS + 1):
            prefix = tuple(tokens[: k * BS])
            if prefix not in self.model:
                break
            blocks.append(self.model[prefix])
        return blocks

    def path_blocks(self, node):
        blocks = []
        while node.parent is not None:
            blocks = node.blocks + blocks
            node = node.parent
        return blocks

    def evict(self, n):
        locked = [b for s in self.seqs.values() for b in self.path_blocks(s.node)]
        locked += [b for node in self.locks for b in self.path_blocks(node)]
        evictable = self.cache.num_evictable_blocks
        freed = self.cache.evict(n)
        assert freed == min(n, evictable)  # exact: unlocked cached blocks are held by the cache only
        assert all(self.pool.is_cached(b) for b in locked)
        gone = {p for p, b in self.model.items() if not self.pool.is_cached(b)}
        assert len(gone) == freed and all(self.pool.refcount(self.model[p]) == 0 for p in gone)
        for p in gone:
            del self.model[p]
        assert all(p[:k] in self.model for p in self.model for k in range(BS, len(p), BS))  # prefix-closed

    def pick(self, data):
        return self.seqs[data.draw(st.sampled_from(sorted(self.seqs)))]

    @rule(tokens=token_lists)
    def start(self, tokens):
        m = self.cache.match_prefix(tokens)
        assert m.blocks == self.expected(tokens, len(tokens) - 1) and m.num_tokens == len(m.blocks) * BS
        self.cache.lock(m.node)
        self.pool.incref(m.blocks)
        need = -(-len(tokens) // BS) - len(m.blocks)
        new = self.pool.allocate(need)
        if new is None:
            self.evict(need - self.pool.num_free)
            new = self.pool.allocate(need)
        if new is None:  # preempted: give everything back
            self.cache.unlock(m.node)
            self.pool.decref(m.blocks)
            return
        self.seqs[self.next_id] = Seq(tokens, m.blocks + new, m.node)
        self.next_id += 1

    def do_insert(self, seq, swap):
        n = len(seq.tokens) // BS
        existing = self.expected(seq.tokens, n * BS)
        dups = self.cache.insert(seq.tokens, seq.blocks[:n])
        assert dups == [b for b, e in zip(seq.blocks, existing) if b != e]
        for k in range(1, n + 1):
            self.model.setdefault(tuple(seq.tokens[: k * BS]), seq.blocks[k - 1])
        m = self.cache.match_prefix(seq.tokens, max_tokens=len(seq.tokens))
        assert m.num_tokens == n * BS and m.blocks == self.expected(seq.tokens, n * BS)
        self.cache.lock(m.node)
        self.cache.unlock(seq.node)
        seq.node = m.node
        if swap:  # use the cached blocks, let the duplicates go
            self.pool.incref(m.blocks)
            self.pool.decref(seq.blocks[:n])
            seq.blocks[:n] = m.blocks

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), swap=st.booleans())
    def insert(self, data, swap):
        self.do_insert(self.pick(data), swap)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), more=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def grow(self, data, more):
        seq = self.pick(data)
        need = -(-(len(seq.tokens) + len(more)) // BS) - len(seq.blocks)
        new = self.pool.allocate(need)
        if new is not None:
            seq.tokens += more
            seq.blocks += new

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), insert_first=st.booleans())
    def release(self, data, insert_first):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        if insert_first:
            self.do_insert(self.seqs[sid], swap=False)
        seq = self.seqs.pop(sid)
        self.cache.unlock(seq.node)
        self.pool.decref(seq.blocks)

    @rule(tokens=token_lists, full=st.booleans())
    def match(self, tokens, full):
        limit = len(tokens) if full else len(tokens) - 1
        m = self.cache.match_prefix(tokens, max_tokens=max(limit, 0))
        assert m.blocks == self.expected(tokens, max(limit, 0))

    @rule(tokens=token_lists)
    def lock(self, tokens):
        m = self.cache.match_prefix(tokens, max_tokens=len(tokens))
        self.cache.lock(m.node)
        self.locks.append(m.node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        self.cache.unlock(self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1))))

    @rule(tokens=token_lists)
    def finish(self, tokens):  # a whole request at once: fills the cache quickly
        self.start(tokens)
        if self.seqs and self.seqs[max(self.seqs)].tokens == tokens:
            seq = self.seqs.pop(max(self.seqs))
            self.do_insert(seq, swap=True)
            self.cache.unlock(seq.node)
            self.pool.decref(seq.blocks)

    @precondition(lambda self: self.cache.num_cached_blocks)
    @rule(n=st.integers(0, NUM_BLOCKS))
    def evict_rule(self, n):
        self.evict(n)

    @invariant()
    def consistent(self):
        self.cache.check_integrity({sid: s.blocks for sid, s in self.seqs.items()})
        assert sorted(self.cache.all_blocks()) == sorted(self.model.values())


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
