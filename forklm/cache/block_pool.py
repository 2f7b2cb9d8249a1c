"""A pool of fixed-size KV blocks: a free list and a reference count per block, no tensors.

Blocks are plain ids `0..num_blocks-1`; the engine maps block `b` to the token slots
`[b * block_size, (b + 1) * block_size)` of its KV tensors. Every holder of a block owns one
reference: a sequence whose block table lists it (once per sequence: `n` samples sharing a prompt
block hold `n` references) or the radix prefix cache. A block is free exactly when nobody holds it.

Each block is in exactly one of three states:

    free     refcount 0, on the free list, can be allocated
    cached   held by the radix cache only (refcount 1): reusable by a later request, or evictable
    in use   held by at least one sequence (it may be cached as well)

NOTE: a cached block that no request uses is represented by the cache holding its own reference
(`add_cache_ref` / `drop_cache_ref`), and the pool remembering which blocks carry that reference.
So "refcount reaches 0" always means "free", and evicting is just dropping the cache's reference;
a block evicted while a sequence still holds it stays alive until that sequence lets go. The
rejected alternative, a separate "cached" flag beside a refcount that counts only requests, needs
two pieces of state to agree and an extra path in `decref` for blocks that hit 0 but stay out of
the free list.

Misuse (unknown ids, references to free blocks, dropping the cache's reference via `decref`) is
an engine bug: it raises ValueError and leaves the pool unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Free map (1 = free), searched in C by bytearray.find: allocation is address-ordered
        # first fit and prefers one contiguous run, so a sequence's blocks are one view of the
        # KV tensors whenever the pool is not fragmented (see attention/paged.py).
        self._free_map = bytearray(b"\x01") * num_blocks
        self._num_free = num_blocks
        self._refcount = [0] * num_blocks
        self._cached: set[int] = set()  # blocks carrying the radix cache's reference
        self._num_cached_only = 0  # cached blocks no sequence holds (refcount 1)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_cached(self) -> int:
        """Blocks held by the radix cache only (not counting cached blocks a sequence also holds). O(1)."""
        return self._num_cached_only

    @property
    def num_in_use(self) -> int:
        """Blocks held by at least one sequence (reference beyond the cache's, if cached). O(1)."""
        return self.num_blocks - self._num_free - self._num_cached_only

    def refcount(self, block: int) -> int:
        self._check_ids([block])
        return self._refcount[block]

    def is_cached(self, block: int) -> bool:
        self._check_ids([block])
        return block in self._cached

    def cached_blocks(self) -> frozenset[int]:
        """All blocks carrying the cache's reference (whether or not a sequence also holds them)."""
        return frozenset(self._cached)

    def allocate(self, n: int) -> list[int] | None:
        """Takes `n` free blocks, each with refcount 1 owned by the caller: the lowest-addressed
        run of `n` consecutive free blocks if there is one, else the `n` lowest free blocks.

        When fewer than `n` blocks are free, returns None and allocates nothing: nothing is
        evicted here. The caller then evicts from the radix cache (`RadixCache.evict`) and tries
        again, or preempts / queues a request; running out of blocks is never an exception.
        """
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate: n must be a non-negative int, got {n!r}")
        if n > self._num_free:
            return None
        run = self.allocate_run(n)
        if run is not None:
            return run
        blocks, fm, i = [], self._free_map, -1
        for _ in range(n):
            i = fm.find(1, i + 1)
            blocks.append(i)
        self._take(blocks)
        return blocks

    def allocate_run(self, n: int) -> list[int] | None:
        """`n` consecutive free blocks (lowest address first), or None if no such run exists."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate_run: n must be a non-negative int, got {n!r}")
        if n > self._num_free:
            return None
        first = self._free_map.find(b"\x01" * n) if n else 0
        if first < 0:
            return None
        blocks = list(range(first, first + n))
        self._take(blocks)
        return blocks

    def allocate_at(self, first: int, n: int) -> list[int] | None:
        """Blocks `first .. first + n - 1` if all of them exist and are free (a run extended in place)."""
        if first < 0 or first + n > self.num_blocks or self._free_map[first : first + n].count(1) != n:
            return None
        blocks = list(range(first, first + n))
        self._take(blocks)
        return blocks

    def _take(self, blocks: list[int]) -> None:
        for b in blocks:
            self._free_map[b] = 0
            self._refcount[b] = 1
        self._num_free -= len(blocks)

    def incref(self, blocks: Iterable[int]) -> None:
        """Adds one reference per occurrence (a new holder shares blocks it did not allocate)."""
        counts = self._counts(blocks)
        for b in counts:
            if self._refcount[b] == 0:
                raise ValueError(f"incref of free block {b}: only allocate() hands out free blocks")
        for b, c in counts.items():
            if self._refcount[b] == 1 and b in self._cached:
                self._num_cached_only -= 1
            self._refcount[b] += c

    def decref(self, blocks: Iterable[int]) -> int:
        """Drops one reference per occurrence; returns how many blocks went back to the free list.

        The cache's own reference cannot be dropped here (that is `drop_cache_ref`): a decref
        that would leave a cached block without it raises, as does a decref of a free block.
        """
        counts = self._counts(blocks)
        for b, c in counts.items():
            if c > self._refcount[b]:
                state = "free" if self._refcount[b] == 0 else f"refcount {self._refcount[b]}"
                raise ValueError(f"decref of block {b} ({c}x) but it is {state}")
            if b in self._cached and c >= self._refcount[b]:
                raise ValueError(
                    f"decref of block {b} ({c}x) would drop the radix cache's reference "
                    f"(refcount {self._refcount[b]}); the cache releases it via drop_cache_ref"
                )
        return self._release(counts)

    def add_cache_ref(self, blocks: Iterable[int]) -> None:
        """The radix cache takes its reference on blocks a sequence holds (refcount >= 1)."""
        counts = self._counts(blocks)
        for b, c in counts.items():
            if c > 1 or b in self._cached:
                raise ValueError(f"block {b} is already cached: the cache holds one reference at most")
            if self._refcount[b] == 0:
                raise ValueError(f"cannot cache free block {b}: the inserting sequence must hold it")
        for b in counts:
            self._refcount[b] += 1
            self._cached.add(b)

    def drop_cache_ref(self, blocks: Iterable[int]) -> int:
        """The radix cache lets go (eviction); returns how many blocks went back to the free list."""
        counts = self._counts(blocks)
        for b, c in counts.items():
            if c > 1 or b not in self._cached:
                raise ValueError(f"drop_cache_ref of block {b}, which the cache does not hold")
        self._num_cached_only -= sum(1 for b in counts if self._refcount[b] == 1)
        self._cached.difference_update(counts)
        return self._release(counts)

    def check_integrity(self, holders: Mapping[Hashable, Iterable[int]] | None = None) -> None:
        """Raises AssertionError naming the first inconsistency found.

        Always: the free list has no duplicates and is exactly the blocks with refcount 0; cached
        blocks are not free; free + cached + in use = all blocks. With `holders` (the sequences'
        holdings, e.g. `{seq_id: block_table}`; not the cache, whose reference is the pool's
        cached set, checked against the tree by `RadixCache.check_integrity`): every block's
        refcount equals its occurrences in `holders`, plus one if cached.
        """
        assert len(self._free_map) == self.num_blocks, "free map has the wrong length"
        free = {b for b, f in enumerate(self._free_map) if f}
        assert self._num_free == len(free), f"num_free {self._num_free} != {len(free)} blocks free in the map"
        cached_only = sum(1 for b in self._cached if self._refcount[b] == 1)
        assert self._num_cached_only == cached_only, f"num_cached {self._num_cached_only} != {cached_only}"
        zero = {b for b, r in enumerate(self._refcount) if r == 0}
        assert free == zero, (
            f"free list != blocks with refcount 0: free but referenced {sorted(free - zero)}, "
            f"unreferenced but not free {sorted(zero - free)}"
        )
        negative = [b for b, r in enumerate(self._refcount) if r < 0]
        assert not negative, f"negative refcounts on blocks {negative}"
        assert not (self._cached & free), f"blocks both cached and free: {sorted(self._cached & free)}"
        assert self.num_free + self.num_cached + self.num_in_use == self.num_blocks
        if holders is None:
            return
        expected = Counter()
        for holder, blocks in holders.items():
            for b in blocks:
                assert isinstance(b, int) and 0 <= b < self.num_blocks, f"holder {holder!r} holds unknown id {b!r}"
                expected[b] += 1
        for b in self._cached:
            expected[b] += 1
        wrong = {b: (r, expected[b]) for b, r in enumerate(self._refcount) if r != expected[b]}
        assert not wrong, f"refcount != holders (+1 if cached) for blocks {{block: (refcount, holders)}}: {wrong}"

    def _counts(self, blocks: Iterable[int]) -> Counter[int]:
        blocks = list(blocks)
        self._check_ids(blocks)
        return Counter(blocks)

    def _check_ids(self, blocks: list[int]) -> None:
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < self.num_blocks:
                raise ValueError(f"unknown block id {b!r}: ids are 0..{self.num_blocks - 1}")

    def _release(self, counts: Counter[int]) -> int:
        freed = 0
        for b, c in counts.items():
            self._refcount[b] -= c
            if self._refcount[b] == 0:
                self._free_map[b] = 1
                freed += 1
            elif self._refcount[b] == 1 and b in self._cached:
                self._num_cached_only += 1
        self._num_free += freed
        return freed
