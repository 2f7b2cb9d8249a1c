"""BlockPool bookkeeping: exact ids, reference counts, allocation failure, misuse, integrity checks."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forklm.cache.block_pool import BlockPool


def test_allocation_prefers_one_contiguous_run_then_lowest_ids():
    pool = BlockPool(8, block_size=4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.decref([1, 3]) == 2
    assert pool.allocate(2) == [5, 6]  # a run exists past the holes: it wins
    assert pool.allocate(3) == [1, 3, 7]  # no run of 3: the lowest free ids
    assert pool.allocate(0) == []
    assert pool.num_free == 0


def test_allocate_run_and_allocate_at():
    pool = BlockPool(8, block_size=4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.decref([1])
    assert pool.allocate_run(2) == [3, 4]  # block 1 alone is too short
    assert pool.allocate_at(5, 2) == [5, 6]  # extend a run in place
    assert pool.allocate_at(6, 2) is None and pool.allocate_at(7, 2) is None  # taken / past the end
    assert pool.allocate_run(2) is None and pool.num_free == 2  # 1 and 7: no run of 2
    assert pool.allocate_run(1) == [1]
    pool.check_integrity({"a": [0, 2, 3, 4, 5, 6, 1]})


def test_refcounts_follow_holders():
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(2)
    pool.incref(a)  # a second sequence shares both blocks
    pool.incref([a[0]])  # a third shares the first
    assert [pool.refcount(b) for b in range(4)] == [3, 2, 0, 0]
    pool.check_integrity({"s1": a, "s2": a, "s3": a[:1]})
    assert pool.decref(a) == 0
    assert pool.decref(a) == 1  # block 1 is free again, block 0 still held by s3
    assert [pool.refcount(b) for b in range(4)] == [1, 0, 0, 0]
    assert pool.num_free == 3 and pool.num_in_use == 1
    pool.check_integrity({"s3": [0]})


def test_failed_allocation_returns_none_and_allocates_nothing():
    pool = BlockPool(3, block_size=2)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(2) is None
    assert pool.num_free == 1 and pool.refcount(2) == 0
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) is None
    pool.check_integrity({"s": [0, 1, 2]})


def test_cache_reference_keeps_blocks_out_of_the_free_list():
    pool = BlockPool(3, block_size=2)
    a = pool.allocate(2)
    pool.add_cache_ref(a)
    assert [pool.refcount(b) for b in a] == [2, 2]
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (1, 0, 2)
    assert pool.decref(a) == 0  # the sequence finishes: cached but unreferenced
    assert (pool.num_free, pool.num_cached, pool.num_in_use) == (1, 2, 0)
    assert pool.is_cached(0) and pool.cached_blocks() == {0, 1}
    pool.check_integrity({})
    pool.incref([1])  # a later request reuses a cached block
    assert (pool.num_cached, pool.num_in_use) == (1, 1)
    assert pool.drop_cache_ref(a) == 1  # eviction frees block 0; block 1 lives on with its sequence
    assert pool.refcount(1) == 1 and not pool.is_cached(1)
    assert pool.allocate(2) == [0, 2]
    pool.check_integrity({"s": [1], "t": [2, 0]})


@pytest.mark.parametrize(
    "action, message",
    [
        (lambda p: p.decref([3]), "decref of block 3"),  # free
        (lambda p: p.decref([0, 0]), "decref of block 0 \\(2x\\)"),  # more than held
        (lambda p: p.decref([1]), "radix cache's reference"),
        (lambda p: p.incref([3]), "incref of free block 3"),
        (lambda p: p.incref([4]), "unknown block id 4"),
        (lambda p: p.decref([-1]), "unknown block id -1"),
        (lambda p: p.refcount(True), "unknown block id True"),
        (lambda p: p.incref(["0"]), "unknown block id '0'"),
        (lambda p: p.allocate(-1), "non-negative"),
        (lambda p: p.add_cache_ref([1]), "already cached"),
        (lambda p: p.add_cache_ref([0, 0]), "already cached"),
        (lambda p: p.add_cache_ref([3]), "cannot cache free block 3"),
        (lambda p: p.drop_cache_ref([0]), "does not hold"),
    ],
)
def test_misuse_raises_and_changes_nothing(action, message):
    pool = BlockPool(4, block_size=2)
    pool.allocate(3)  # 0, 1, 2 held by one sequence
    pool.add_cache_ref([1])
    pool.decref([1])  # block 1: cached only
    before = ([pool.refcount(b) for b in range(4)], bytes(pool._free_map), pool.cached_blocks())
    with pytest.raises(ValueError, match=message):
        action(pool)
    assert ([pool.refcount(b) for b in range(4)], bytes(pool._free_map), pool.cached_blocks()) == before
    pool.check_integrity({"s": [0, 2]})


def test_decref_validates_the_whole_list_before_changing_anything():
    pool = BlockPool(4, block_size=2)
    pool.allocate(2)
    with pytest.raises(ValueError):
        pool.decref([0, 1, 3])  # 3 is free: 0 and 1 must keep their references
    assert (pool.refcount(0), pool.refcount(1), pool.num_free) == (1, 1, 2)


@pytest.mark.parametrize("args", [(0, 4), (4, 0), (-1, 4), (4, 2.0)])
def test_constructor_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        BlockPool(*args)


def _corrupt_referenced_free(p):
    p._refcount[3] = 1  # free block with a reference


def _corrupt_free_count(p):
    p._num_free += 1


def _corrupt_leak(p):
    p._free_map[3] = 0  # refcount 0 but not free: leaked
    p._num_free -= 1


def _corrupt_cached_free(p):
    p._cached.add(3)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (_corrupt_referenced_free, "free but referenced \\[3\\]"),
        (_corrupt_free_count, "num_free 2 != 1"),
        (_corrupt_leak, "unreferenced but not free \\[3\\]"),
        (_corrupt_cached_free, "both cached and free"),
    ],
)
def test_integrity_check_catches_corruption(corrupt, message):
    pool = BlockPool(4, block_size=2)
    pool.allocate(3)
    pool.check_integrity({"s": [0, 1, 2]})
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_integrity_check_compares_refcounts_with_holders():
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(2)
    pool.incref(a[:1])
    pool.add_cache_ref(a[1:])
    pool.check_integrity({"s": a, "t": a[:1]})  # block 1: s + cache
    with pytest.raises(AssertionError, match="0: \\(2, 1\\)"):
        pool.check_integrity({"s": a})  # t's reference unaccounted for
    with pytest.raises(AssertionError, match="1: \\(2, 3\\)"):
        pool.check_integrity({"s": a, "t": a})
    with pytest.raises(AssertionError, match="unknown id 9"):
        pool.check_integrity({"s": [9]})


ops = st.lists(
    st.one_of(
        st.tuples(st.just("allocate"), st.integers(0, 4)),
        st.tuples(st.just("share"), st.integers(0, 10)),
        st.tuples(st.just("release"), st.integers(0, 10)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_operations_match_a_counting_model(ops):
    pool = BlockPool(8, block_size=2)
    holders: dict[int, list[int]] = {}
    for i, (op, arg) in enumerate(ops):
        if op == "allocate":
            free_before = pool.num_free
            got = pool.allocate(arg)
            if arg > free_before:
                assert got is None and pool.num_free == free_before
            else:
                assert len(got) == arg and all(pool.refcount(b) == 1 for b in got)
                holders[i] = got
        elif holders:
            key = sorted(holders)[arg % len(holders)]
            if op == "share":
                pool.incref(holders[key])
                holders[i] = list(holders[key])
            else:
                blocks = holders.pop(key)
                counts = Counter(b for bs in holders.values() for b in bs)
                assert pool.decref(blocks) == sum(1 for b in set(blocks) if counts[b] == 0)
        pool.check_integrity(holders)
        held = {b for bs in holders.values() for b in bs}
        assert pool.num_free == 8 - len(held)
