"""A radix tree from token sequences to KV blocks of a `BlockPool` (RadixAttention, block granularity).

Only full blocks are cached: every node's key is a multiple of `block_size` tokens and its value
is one block id per `block_size` tokens. Edges leaving a node differ in their first block, so a
node's children are keyed by their first block's tokens, and nodes split only at block
boundaries. The cache holds one reference on each block it stores (see `block_pool.py`).

Contract for the engine:
- `match_prefix` returns a node handle; `lock` it before the next `evict` call, and `unlock`
  it when the request finishes. A locked node and its ancestors
  are never evicted; locks are counted. An unlocked handle may be evicted: locking it then raises.
  The lock keeps the blocks in the tree; a sequence that lists matched blocks in its block table
  also takes its own reference (`pool.incref`) and drops it when done (`pool.decref`).
- The last prompt token is always recomputed, so there are logits to sample from: by default
  `match_prefix(tokens)` matches at most `len(tokens) - 1` tokens.
- `insert` is called when a prompt's prefill completes and when a sequence finishes, with the
  tokens whose KV is in `blocks`. Only verified tokens: unverified speculative (draft) tokens
  must never be inserted. A sequence that keeps running after inserting re-matches and locks
  the new node (and unlocks the old one), so that the blocks it uses stay unevictable.
- When `BlockPool.allocate` returns None, `evict(k)` frees up to `k` blocks (LRU unlocked leaves).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from forklm.cache.block_pool import BlockPool


class RadixNode:
    """A node of the tree; outside this module, an opaque handle for `lock` / `unlock`."""

    __slots__ = ("key", "blocks", "children", "parent", "lock_ref", "last_access", "uid", "evicted")

    def __init__(self, key: tuple[int, ...], blocks: list[int], parent: RadixNode | None, uid: int) -> None:
        self.key = key  # tokens of this edge, len(key) == len(blocks) * block_size
        self.blocks = blocks
        self.children: dict[tuple[int, ...], RadixNode] = {}  # keyed by the child's first block of tokens
        self.parent = parent
        self.lock_ref = 0  # locks on this node or any descendant
        self.last_access = 0.0
        self.uid = uid  # creation order, breaks LRU ties deterministically
        self.evicted = False


@dataclass(frozen=True)
class PrefixMatch:
    num_tokens: int  # tokens matched, a multiple of block_size
    blocks: list[int]  # num_tokens // block_size block ids, in token order
    node: RadixNode  # the node whose key ends exactly at num_tokens (the root if nothing matched)


class RadixCache:
    def __init__(self, pool: BlockPool, clock: Callable[[], float] | None = None) -> None:
        """`clock` gives access times for LRU; by default a counter ticking once per operation."""
        self.pool = pool
        self.block_size = pool.block_size
        self._uids = itertools.count()
        ticks = itertools.count(1)
        self._clock = clock if clock is not None else (lambda: float(next(ticks)))
        self._root = RadixNode((), [], None, next(self._uids))
        self._num_cached = 0
        self._num_evictable = 0  # blocks of nodes with lock_ref == 0
        self._leaves: set[RadixNode] = set()  # childless nodes (eviction candidates when unlocked)

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks in unlocked nodes: what `evict` can free when requests hold only locked blocks."""
        return self._num_evictable

    def match_prefix(self, tokens: Sequence[int], max_tokens: int | None = None) -> PrefixMatch:
        """Longest cached prefix of `tokens[:max_tokens]`, in whole blocks; refreshes its LRU time.

        `max_tokens` defaults to `len(tokens) - 1` (the last prompt token is always recomputed);
        pass `len(tokens)` to match everything. When the match ends inside a node's key, the node
        is split there so that the returned handle covers exactly the matched blocks. Reference
        counts are unchanged: lock the node, and incref the blocks the sequence will hold.
        """
        if max_tokens is not None and max_tokens < 0:
            raise ValueError(f"match_prefix: max_tokens must be >= 0, got {max_tokens}")
        limit = max(len(tokens) - 1, 0) if max_tokens is None else max_tokens
        node, used, blocks = self._walk(tuple(tokens[: limit - limit % self.block_size]))
        if used < len(node.blocks):
            node = self._split(node, used)
        self._touch(node)
        return PrefixMatch(len(blocks) * self.block_size, blocks, node)

    def lock(self, node: RadixNode) -> None:
        """Marks `node` and its ancestors in use (never evicted) until the matching `unlock`."""
        self._check_attached(node)
        while node is not self._root:
            if node.lock_ref == 0:
                self._num_evictable -= len(node.blocks)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        self._check_attached(node)
        if node is not self._root and node.lock_ref == 0:
            raise ValueError("unlock of a node that is not locked")
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_evictable += len(node.blocks)
            node = node.parent

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> list[int]:
        """Caches the full blocks of `tokens`; returns the caller's blocks the tree already had.

        `blocks` holds the KV of `tokens`, one block per full block of tokens
        (`len(blocks) == len(tokens) // block_size`; a trailing partial block is not cached),
        and the caller holds a reference on each. Where the tree already caches a prefix of
        `tokens`, its blocks win: each caller block there that differs from the tree's is a
        duplicate, returned in token order; the caller decrefs it once it stops reading it.
        The blocks past the existing prefix get the cache's reference (`add_cache_ref`); the
        caller's own references are untouched. Refreshes the path's LRU time.
        """
        tokens, blocks = tuple(tokens), list(blocks)
        n = len(tokens) // self.block_size
        if len(blocks) != n:
            raise ValueError(
                f"insert: {len(tokens)} tokens fill {n} blocks of {self.block_size}, got {len(blocks)} blocks"
            )
        if len(set(blocks)) != n:
            raise ValueError(f"insert: repeated block ids in {blocks}")
        for b in blocks:
            if self.pool.refcount(b) == 0:
                raise ValueError(f"insert: block {b} is free; the caller must hold the blocks it inserts")
        tokens = tokens[: n * self.block_size]
        node, used, existing = self._walk(tokens)
        for i, b in enumerate(blocks):
            if (i >= len(existing) or b != existing[i]) and self.pool.is_cached(b):
                raise ValueError(f"insert: block {b} is cached under another prefix")
        duplicates = [b for b, e in zip(blocks, existing) if b != e]
        k = len(existing)
        if k < n:
            if used < len(node.blocks):
                node = self._split(node, used)
            leaf = RadixNode(tokens[k * self.block_size :], blocks[k:], node, next(self._uids))
            node.children[self._first(leaf.key)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self.pool.add_cache_ref(leaf.blocks)
            self._num_cached += n - k
            self._num_evictable += n - k
            node = leaf
        self._touch(node)
        return duplicates

    def evict(self, num_blocks: int) -> int:
        """Drops the cache's reference on up to `num_blocks` blocks, least recently used first.

        Evicts from unlocked leaves (the tail blocks of a leaf first, so the prefix stays useful);
        a parent left as an unlocked leaf becomes a candidate too. Stops once `num_blocks` blocks
        went back to the free list or nothing unlocked is left; returns how many went back. A
        block a sequence still holds leaves the tree without being freed (counted, not returned).
        """
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"evict: num_blocks must be a non-negative int, got {num_blocks!r}")
        heap = [(n.last_access, n.uid, n) for n in self._leaves if not n.lock_ref]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            need = num_blocks - freed
            if need < len(leaf.blocks):
                self._split(leaf, len(leaf.blocks) - need)  # leaf keeps its last `need` blocks
            parent, leaf.parent, leaf.evicted = leaf.parent, None, True
            del parent.children[self._first(leaf.key)]
            self._leaves.discard(leaf)
            if parent is not self._root and not parent.children:
                self._leaves.add(parent)
            self._num_cached -= len(leaf.blocks)
            self._num_evictable -= len(leaf.blocks)
            freed += self.pool.drop_cache_ref(leaf.blocks)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return freed

    def all_blocks(self) -> list[int]:
        return [b for node in self._nodes() for b in node.blocks]

    def check_integrity(self, holders: Mapping[Hashable, Iterable[int]] | None = None) -> None:
        """Raises AssertionError on an inconsistent tree, then runs the pool's check with `holders`.

        Tree: parent/child links and child keys agree; keys are whole blocks; lock counts cover
        the descendants' locks; no block appears twice; the tree's blocks are the pool's cached
        set; the cached / evictable counters match the tree.
        """
        bs, seen, evictable = self.block_size, [], 0
        assert not self._root.blocks and self._root.parent is None, "root must be empty and parentless"
        for node in self._nodes():
            for first, child in node.children.items():
                assert child.parent is node and not child.evicted, f"broken parent link under key {first}"
                assert first == self._first(child.key), f"child keyed {first} but its key starts {child.key[:bs]}"
            if node is self._root:
                continue
            assert node.blocks and len(node.key) == len(node.blocks) * bs, (
                f"node with {len(node.key)} tokens and blocks {node.blocks} (block_size {bs})"
            )
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, f"lock_ref {node.lock_ref} < children's {child_locks}"
            seen.extend(node.blocks)
            evictable += len(node.blocks) if node.lock_ref == 0 else 0
        twice = sorted(b for b in set(seen) if seen.count(b) > 1)
        assert not twice, f"blocks cached twice: {twice}"
        cached = self.pool.cached_blocks()
        assert set(seen) == cached, f"tree blocks {sorted(set(seen))} != pool's cached set {sorted(cached)}"
        assert self._num_cached == len(seen), f"num_cached_blocks {self._num_cached} != {len(seen)} in the tree"
        assert self._num_evictable == evictable, f"num_evictable_blocks {self._num_evictable} != {evictable}"
        leaves = {n for n in self._nodes() if n is not self._root and not n.children}
        assert self._leaves == leaves, "the leaf set does not match the tree's childless nodes"
        self.pool.check_integrity(holders)

    def _first(self, key: tuple[int, ...]) -> tuple[int, ...]:
        return key[: self.block_size]

    def _walk(self, tokens: tuple[int, ...]) -> tuple[RadixNode, int, list[int]]:
        """Read-only descent: (deepest node reached, how many of its blocks matched, matched blocks)."""
        bs, node, pos, blocks = self.block_size, self._root, 0, []
        while pos + bs <= len(tokens):
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            used = 1
            while used < len(child.blocks) and pos + (used + 1) * bs <= len(tokens):
                if child.key[used * bs : (used + 1) * bs] != tokens[pos + used * bs : pos + (used + 1) * bs]:
                    break
                used += 1
            blocks.extend(child.blocks[:used])
            pos += used * bs
            node = child
            if used < len(child.blocks):
                return node, used, blocks
        return node, len(node.blocks), blocks

    def _split(self, node: RadixNode, used: int) -> RadixNode:
        """Splits `node` after its first `used` blocks; returns the new parent holding them.

        `node` keeps its identity (handles stay valid) and the tail of its key; the new parent
        inherits its lock count and access time, so locks and evictable counts are unchanged.
        """
        cut = used * self.block_size
        head = RadixNode(node.key[:cut], node.blocks[:used], node.parent, next(self._uids))
        head.lock_ref, head.last_access = node.lock_ref, node.last_access
        node.parent.children[self._first(node.key)] = head
        node.key, node.blocks, node.parent = node.key[cut:], node.blocks[used:], head
        head.children[self._first(node.key)] = node
        return head

    def _touch(self, node: RadixNode) -> None:
        now = self._clock()
        while node is not self._root:
            node.last_access = now
            node = node.parent

    def _check_attached(self, node: RadixNode) -> None:
        if not isinstance(node, RadixNode):
            raise ValueError(f"expected a RadixNode handle from match_prefix, got {type(node).__name__}")
        if node.evicted:
            raise ValueError("node was evicted: lock a handle before anything can evict it")

    def _nodes(self) -> Iterable[RadixNode]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
