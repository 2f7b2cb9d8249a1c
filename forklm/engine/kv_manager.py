"""The KV manager: the only code that touches `BlockPool` reference counts and the `RadixCache`.

It allocates (evicting cached prefixes when the pool runs dry), admits prompts (cached prefix by
reference, the rest as one run), forks samples, reserves their lanes, extends sequences, inserts
computed blocks into the prefix cache, locks and unlocks, and frees. The scheduler asks it
questions (`room`, `lane_blocks`, `start_sample`, ...) and never touches a count itself.

Layout policy (what makes the decode step copy no context, `attention/paged.py`):
- a prompt's blocks are one run when the pool has one (address-ordered first fit);
- the fresh samples of a request start together as a *lane group*: one run of `rows * K`
  blocks, sample i owning blocks `[i*K, (i+1)*K)`, so their tails are one strided view;
- a request of one sample continues in its prompt's run (its blocks reserved at admission);
- a sequence that outgrows its blocks takes the next `lane_ahead_tokens` worth as one run,
  extending in place when the following blocks are free;
- reservations ahead are made only while the pool keeps one block per running sequence free
  beside them; under pressure every sequence grows one block at a time (then preemption).
"""

from __future__ import annotations

from forklm.cache.block_pool import BlockPool
from forklm.cache.paged_kv import PagedKVCache
from forklm.cache.radix_cache import RadixCache
from forklm.engine.request import RequestState, Sequence
from forklm.sampling.sample_state import SampleState


class KVManager:
    def __init__(self, kv: PagedKVCache, num_blocks: int, block_size: int, prefix_cache: bool, lane_ahead_tokens: int):
        self.kv = kv
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.lane_ahead_tokens = lane_ahead_tokens
        self.pool = BlockPool(num_blocks, block_size)
        self.radix = RadixCache(self.pool)
        # draft-model speculation: the draft's twin KV (same block ids), copied with the target's;
        # then only blocks whose draft KV exists too enter the prefix cache
        self.draft_kv: PagedKVCache | None = None

    def _copy_slots(self, src, dst) -> None:
        src, dst = list(src), list(dst)
        self.kv.copy_slots(src, dst)
        if self.draft_kv is not None:
            self.draft_kv.copy_slots(src, dst)

    # ------------------------------------------------------------------ questions
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def room(self) -> int:
        """Blocks that can be had now: free ones plus cached prefixes nobody uses."""
        return self.pool.num_free + (self.radix.num_evictable_blocks if self.prefix_cache else 0)

    def cached_prefix_len(self, prompt: list[int]) -> int:
        return self.radix.match_prefix(prompt).num_tokens if self.prefix_cache else 0

    def lane_blocks(self, req: RequestState, start: int, min_end: int, rows: int, margin: int) -> int:
        """Blocks per row for `rows` rows whose next block holds token `start` and that need slots
        up to token `min_end` now: up to `lane_ahead_tokens` further (never past the request's
        last token) while `rows * that + margin` blocks are free; else just enough for `min_end`."""
        bs = self.block_size
        first = start // bs
        need = max(1, -(-min_end // bs) - first)
        end = min(len(req.prompt_ids) + req.params.max_tokens, start + self.lane_ahead_tokens)
        ahead = -(-end // bs) - first
        if ahead <= need:
            return need
        return ahead if self.pool.num_free >= rows * ahead + margin else need

    # ------------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks, evicting cached prefixes if that makes enough room; None (nothing evicted) if not."""
        if n == 0:
            return []
        blocks = self.pool.allocate(n)
        if blocks is None and self.prefix_cache:
            if self.pool.num_free + self.radix.num_evictable_blocks < n:
                return None
            self.radix.evict(n - self.pool.num_free)
            blocks = self.pool.allocate(n)
        return blocks

    def admit_prompt(self, req: RequestState, reserve: int, margin: int) -> bool:
        """Takes blocks for the whole prompt (its cached prefix by reference, locked) and, for a
        request of one sample, its lane ahead in the same run. False (nothing held) if they do
        not fit beside `reserve` blocks kept for running work."""
        bs = self.block_size
        prompt = req.prompt_ids
        matched: list[int] = []
        node = None
        if self.prefix_cache:
            m = self.radix.match_prefix(prompt)
            node, matched = m.node, list(m.blocks)
            self.radix.lock(node)
            self.pool.incref(matched)
        need = -(-len(prompt) // bs) - len(matched)
        new = None
        if req.num_sequences == 1:  # the sample continues in the prompt's blocks: reserve its lane with them
            P = len(prompt)
            lane = self.lane_blocks(req, P, P + 1, 1, margin) + P // bs - len(matched)
            if self.pool.num_free >= lane + margin:
                new = self.pool.allocate_run(lane)
        if new is None:
            new = self.allocate(need) if need + reserve <= self.room() else None
        if new is None:
            if node is not None:
                self.pool.decref(matched)
                self.radix.unlock(node)
            return False
        req.locked_node = node
        req.prompt_blocks = matched + new
        req.cached_tokens = len(matched) * bs
        return True

    def start_lane_group(self, req: RequestState, fresh: list[SampleState], margin: int) -> list[Sequence]:
        """Sequences for fresh samples (one drawn token, nothing computed) as one lane group;
        empty if no run of that size is free."""
        bs = self.block_size
        P = len(req.prompt_ids)
        full, rem = divmod(P, bs)
        k = self.lane_blocks(req, P, P + 1, len(fresh), margin)
        run = self.pool.allocate_run(len(fresh) * k)
        if run is None:
            return []
        shared = req.prompt_blocks[:full]
        seqs = []
        for i, st in enumerate(fresh):
            self.pool.incref(shared)
            seqs.append(Sequence(req, req.prompt_ids + st.token_ids + st.ahead, shared + run[i * k : (i + 1) * k], P, st))
        if rem:  # each sample's copy of the prompt's partial last block
            src = req.prompt_blocks[full] * bs
            self._copy_slots(
                [src + j for _ in fresh for j in range(rem)],
                [run[i * k] * bs + j for i in range(len(fresh)) for j in range(rem)],
            )
        return seqs

    def start_sample(self, req: RequestState, st: SampleState, margin: int) -> Sequence | None:
        """A sequence for a sample that has tokens but no KV: the prompt's full blocks shared, the
        partial last block copied, blocks for its own tokens allocated (computed by the next chunk).
        A request of one sample shares all its prompt blocks (the partial one and the lane
        reserved at admission). None if the blocks cannot be had."""
        bs = self.block_size
        P = len(req.prompt_ids)
        full, rem = divmod(P, bs)
        tokens = req.prompt_ids + st.token_ids + st.ahead  # known tokens (jump-forward) are computed too
        if req.num_sequences == 1:
            table = list(req.prompt_blocks)
            need = -(-len(tokens) // bs) - len(table)
            new: list[int] | None = []
            if need > 0:
                new = (self.pool.allocate_at(table[-1] + 1, need) if table else None) or self.allocate(need)
                if new is None:
                    return None
            self.pool.incref(table)
            return Sequence(req, tokens, table + new, P, st)
        need = -(-len(tokens) // bs) - full
        lane = self.lane_blocks(req, full * bs, len(tokens), 1, margin)
        new = self.pool.allocate_run(lane) if lane > need else None
        if new is None:
            new = self.allocate(need)
        if new is None:
            return None
        shared = req.prompt_blocks[:full]
        self.pool.incref(shared)
        if rem:
            src = req.prompt_blocks[full] * bs
            self._copy_slots(range(src, src + rem), range(new[0] * bs, new[0] * bs + rem))
        return Sequence(req, tokens, shared + new, P, st)

    def fork_sequence(self, parent: Sequence, state: SampleState) -> Sequence | None:
        """A beam's further child (sampling/beam.py): the parent's computed tokens plus the child's
        new one, the parent's full blocks shared by reference, its partial last block copied (a
        parent's first child continues in the parent's own sequence instead). None if no block
        can be had for the copy (the child is then recomputed like a preempted sample)."""
        bs = self.block_size
        n = parent.num_computed
        full, rem = divmod(n, bs)
        new: list[int] = []
        if rem:
            got = self.allocate(1)
            if got is None:
                return None
            new = got
            src = parent.block_table[full] * bs
            try:
                self._copy_slots(range(src, src + rem), range(new[0] * bs, new[0] * bs + rem))
            except BaseException:
                self.pool.decref(new)
                raise
        shared = parent.block_table[:full]
        self.pool.incref(shared)
        return Sequence(parent.request, parent.tokens[:n] + [state.token_ids[-1]], shared + new, n, state)

    def ensure_slots(self, seq: Sequence, count: int, margin: int) -> bool:
        """Slots for `seq`'s next `count` tokens (a multi-token extend: jump-forward, later draft
        verification): a lane ahead that covers them while blocks are plentiful, else block by
        block. False if they cannot all be had (blocks taken stay in the table; preemption or the
        sequence's release returns them)."""
        bs = self.block_size
        end = seq.num_computed + count
        have = len(seq.block_table) * bs
        if end <= have:
            return True
        ahead = self.lane_blocks(seq.request, have, end, 1, margin)
        if ahead > 1:
            blocks = self.pool.allocate_at(seq.block_table[-1] + 1, ahead) or self.pool.allocate_run(ahead)
            if blocks is not None:
                seq.block_table.extend(blocks)
                return True
        while len(seq.block_table) * bs < end:
            last = seq.block_table[-1] if seq.block_table else -2
            blocks = self.pool.allocate_at(last + 1, 1) or self.allocate(1)
            if blocks is None:
                return False
            seq.block_table.extend(blocks)
        return True

    def trim(self, seq: Sequence, keep_blocks: int) -> int:
        """Rollback after draft verification: frees the sequence's blocks past its first
        `keep_blocks` (those taken only for rejected draft tokens); returns how many it freed.
        The freed blocks never entered the prefix cache (only computed, verified tokens do, when
        the sequence is released)."""
        extra = seq.block_table[keep_blocks:]
        if extra:
            self.pool.decref(extra)
            del seq.block_table[keep_blocks:]
        return len(extra)

    # ------------------------------------------------------------------ the prefix cache
    def prompt_done(self, req: RequestState) -> None:
        """The prompt's KV is complete: cache its full blocks at once, so siblings and other
        requests hit them; switch to the tree's blocks where the tree already had them."""
        if not self.prefix_cache:
            return
        bs = self.block_size
        full = len(req.prompt_ids) // bs
        duplicates = self.radix.insert(req.prompt_ids[: full * bs], req.prompt_blocks[:full])
        m = self.radix.match_prefix(req.prompt_ids, max_tokens=full * bs)
        self.radix.lock(m.node)
        if duplicates:
            # The tree already held some of these blocks (another request prefilled the same
            # tokens meanwhile, or the last block was recomputed): use the tree's, free ours.
            self.pool.incref(m.blocks)
            self.pool.decref(req.prompt_blocks[:full])
            req.prompt_blocks = list(m.blocks) + req.prompt_blocks[full:]
        if req.locked_node is not None:
            self.radix.unlock(req.locked_node)
        req.locked_node = m.node

    def release_sequence(self, seq: Sequence, cache: bool) -> None:
        """Drops a sequence's references; with `cache`, its computed full blocks join the prefix
        cache first (only verified tokens: everything computed is; with a draft model, only
        tokens whose draft KV is computed too)."""
        if cache and self.prefix_cache:
            done = seq.num_computed if self.draft_kv is None else min(seq.num_computed, seq.draft_computed)
            full = done // self.block_size
            self.radix.insert(seq.tokens[: full * self.block_size], seq.block_table[:full])
        self.pool.decref(seq.block_table)
        seq.block_table = []

    def release_prompt(self, req: RequestState) -> None:
        if req.prompt_blocks:
            self.pool.decref(req.prompt_blocks)
            req.prompt_blocks = []
        if req.locked_node is not None:
            self.radix.unlock(req.locked_node)
            req.locked_node = None

    def clear_prefix_cache(self) -> int:
        """Evicts every cached prefix no request is using; returns the blocks freed."""
        return self.radix.evict(self.radix.num_evictable_blocks) if self.prefix_cache else 0

    def check_integrity(self, holders) -> None:
        self.radix.check_integrity(holders)
