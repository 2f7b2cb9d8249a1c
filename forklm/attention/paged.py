"""Attention for one engine step over the paged KV cache: decode rows and prefill chunks together.

The batch's flattened rows are `[decode rows (one token each) | chunk 0 | chunk 1 | ...]`.
It implements the model's interface `attend(layer, q [T, h, D], k [T, g, D], v [T, g, D])`.

Nothing of the context is copied: every read is a view of the pool's K/V tensors
(`cache/paged_kv.py`: per layer `[g, slots, D]`, a run of consecutive slots is one view).

Decode rows. The planner orders the rows by their block tables (rows sharing blocks become
neighbours) and splits each row's keys into
- shared segments (`shared_prefix.py`): full blocks that several rows list, read once for all
  of them: "bifurcated" (all `rows · p` query rows of a KV head in one product) or "expanded"
  (a stride-0 view per row, as a conventional engine reads it), chosen per segment by
  `attention/auto.py`'s measured rule;
- each row's tail (its own blocks, partial block and current token), as runs of consecutive
  slots. Neighbouring rows whose tails are single runs of equal length at a constant slot
  stride (the samples of one request, whose blocks the engine allocates as one strided lane
  group) are one strided view `[rows, g, length, D]` and one product. When the planner knows the
  pool's size (`num_slots`), rows whose last runs differ in length (samples that accepted
  different numbers of draft tokens, or jumped ahead by a forced run) still make one view, read
  to the longest length, each row's surplus slots hidden by an additive mask; and the k rows of a
  multi-token extend are one unit, k·p query rows per KV head over one view, causal by the mask
  (units of equal k in strided lanes are one read for all of them).
Every row's first tail read gives its partial output; shared segments and further runs are
merged by log-sum-exp in float32 (docs/design.md "Attention over segments").

Prefill chunks: the chunk's queries attend causally to the chunk itself and to the tokens before
it (their runs, read in place), merged by log-sum-exp.

The plan is updated, not rebuilt, from one step to the next (`StepPlanner`): while the same
rows decode one token each, the previous step's decode plan is advanced in place (each tail's
last run grows by one slot; a row of its own whose new slot starts a new block elsewhere gets a
new run). Only when rows join or leave, or a row of a multi-row tail group leaves its lane, is it
rebuilt: then the shared-segment trie comes from a cache keyed on the rows' identity and
shareable prefixes, and each row's tail runs are extended incrementally (`TailRuns`).
A plan is valid for its own step only: the next step's may be the same objects, advanced.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from forklm.attention.auto import choose_decode_path
from forklm.attention.segments import attend_segment, merge_partials
from forklm.attention.shared_prefix import SharedSegment, shared_segments
from forklm.cache.paged_kv import PagedKVCache, slot_runs, slots_of
from forklm.kernels.cpu_attention import CpuAttentionPlan

Runs = list[tuple[int, int]]  # [(first_slot, num_tokens), ...]


class DecodeRow:
    """What the planner needs of one decode row: the token at `position` is new.

    shareable_blocks: leading full blocks other rows may list (None: all full blocks).
    key: identity across steps (for the planner's caches); None: not cached. The planner assumes
    a keyed row's `block_table` is only ever appended to while it keeps its key.
    """

    __slots__ = ("block_table", "position", "shareable_blocks", "key")

    def __init__(self, block_table: Sequence[int], position: int, shareable_blocks: int | None = None,
                 key: Hashable = None) -> None:
        self.block_table = block_table
        self.position = position
        self.shareable_blocks = shareable_blocks
        self.key = key


@dataclass
class StridedRun:
    first_slot: int
    stride: int  # slots between consecutive rows' runs (0 while the group has one row)
    length: int


@dataclass
class TailGroup:
    """Plan rows [row0, row0 + num_rows) whose tails line up, in units of `rows_per_unit` rows
    (a unit: one sequence's rows, one for a decode row, k for a k-token extend): run j of unit u
    is the `runs[j].length` slots from `runs[j].first_slot + u * runs[j].stride` (one strided
    view and one product per run; run 0 gives the rows' first partial output, later runs are
    merged by log-sum-exp).

    `lengths` (None: every row reads all of its runs): each plan row's valid length of the last
    run, when the rows of the group reach different lengths there (the rows of an extend, samples
    that accepted different numbers of draft tokens); the last run is then read to its longest
    length `runs[-1].length` with a mask hiding each row's slots past its own length."""

    row0: int
    num_rows: int
    runs: list[StridedRun]
    rows_per_unit: int = 1
    lengths: list[int] | None = None

    @property
    def length(self) -> int:
        return sum(r.length for r in self.runs)

    @property
    def num_units(self) -> int:
        return self.num_rows // self.rows_per_unit


@dataclass
class ExtraRead:
    """Plan rows [row0, row1) read the slots [first_slot, first_slot + length) (merged by LSE)."""

    row0: int
    row1: int
    first_slot: int
    length: int
    bifurcated: bool  # one product for all rows (True) or a stride-0 view per row (False)


@dataclass
class PrefillChunk:
    row_start: int  # first batch row of the chunk
    num_tokens: int
    prefix_runs: Runs  # slots of the sequence's tokens before the chunk


@dataclass
class StepPlan:
    write_slots: torch.Tensor  # [T] slot of every batch row's new K/V
    num_decode: int = 0
    order: torch.Tensor | None = None  # [B] plan row i is decode row order[i]; None: identity
    tails: list[TailGroup] = field(default_factory=list)  # cover every plan row once, in row order
    extra: list[ExtraRead] = field(default_factory=list)  # shared segments, further tail runs
    num_shared_reads: int = 0  # shared-segment reads read once for several rows
    chunks: list[PrefillChunk] = field(default_factory=list)
    kernel_plan: object = None  # SegmentPlan (Triton) or CpuAttentionPlan (C++) when decode rows use one kernel
    kernel_items: list = field(default_factory=list)  # the CpuAttentionPlan's items (C++: chunk rows' too)

    @property
    def segments(self) -> list[ExtraRead]:
        """Shared-segment reads (rows >= 2)."""
        return [e for e in self.extra if e.row1 - e.row0 >= 2]


@dataclass
class _DecodePlanState:
    """The last step's decode plan and the rows it was made for (what `_advance` checks)."""

    keys: list[Hashable]
    tables: list[Sequence[int]]
    positions: list[int]
    slots: list[int]
    group_of: list[int]  # row -> index of its tail group
    tails: list[TailGroup]
    extra: list[ExtraRead]
    order: torch.Tensor | None
    num_shared_reads: int


class TailRuns:
    """A row's tail as runs of slots, extended as the row grows (O(new tokens) per step)."""

    __slots__ = ("table_id", "start", "end", "runs", "prefix")

    def __init__(self) -> None:
        self.prefix: tuple[int, ...] = ()  # the row's shareable leading blocks (the trie's key)
        self.table_id = -1
        self.start = 0  # first token of the tail
        self.end = 0  # tokens [start, end) are in `runs`
        self.runs: Runs = []

    def update(self, table: Sequence[int], start: int, end: int, block_size: int) -> Runs:
        if id(table) != self.table_id or start != self.start or end < self.end:
            self.table_id, self.start, self.end, self.runs = id(table), start, start, []
        if end > self.end:
            more = slot_runs(table, self.end, end, block_size)
            if self.runs and more and self.runs[-1][0] + self.runs[-1][1] == more[0][0]:
                self.runs[-1] = (self.runs[-1][0], self.runs[-1][1] + more[0][1])
                more = more[1:]
            self.runs.extend(more)
            self.end = end
        return self.runs


class StepPlanner:
    """Builds each step's `StepPlan`, caching what does not change between steps."""

    def __init__(
        self,
        block_size: int,
        shared_attention: str,  # "auto" | "bifurcated" | "standard"
        device: torch.device,
        decode_kernel: str = "torch",  # "torch" (a product per read), "triton" or "cpu" (one fused kernel)
        num_heads: int = 0,  # needed by the Triton kernel's plan
        num_kv_heads: int = 0,
        num_slots: int | None = None,  # the pool's slots: enables masked reads of ragged tails (see TailGroup)
    ) -> None:
        self.block_size = block_size
        self.num_slots = num_slots
        self.shared_attention = shared_attention
        self.device = device
        self.decode_kernel = decode_kernel
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self._tails: dict[Hashable, TailRuns] = {}
        self._segments_key: tuple | None = None
        self._segments: tuple[list[SharedSegment], list[int]] = ([], [])
        self._last: _DecodePlanState | None = None
        self.rebuilds = 0  # decode plans built from scratch (the rest were advanced in place)

    def forget(self, key: Hashable) -> None:
        """Drops a row's cached tail (call when the row leaves for good)."""
        self._tails.pop(key, None)

    def plan(self, decode_rows: Sequence[DecodeRow], chunks: Sequence[tuple[Sequence[int], int, int]]) -> StepPlan:
        """Where each new token's K/V goes and what each row attends to, for batch rows laid out
        as `[decode rows | chunk 0 | chunk 1 | ...]` (chunks: (block_table, s0, s1), tokens
        [s0, s1) new)."""
        bs, dev = self.block_size, self.device
        decode_slots = [r.block_table[r.position // bs] * bs + r.position % bs for r in decode_rows]
        slots = list(decode_slots)
        plan_chunks = []
        row = len(decode_rows)
        for table, s0, s1 in chunks:
            slots.extend(slots_of(table, s0, s1, bs))
            plan_chunks.append(PrefillChunk(row, s1 - s0, slot_runs(table, 0, s0, bs)))
            row += s1 - s0
        plan = StepPlan(torch.tensor(slots, dtype=torch.long, device=dev), len(decode_rows), chunks=plan_chunks)
        if decode_rows and not self._advance(plan, decode_rows, decode_slots):
            self.rebuilds += 1
            self._plan_decode(plan, decode_rows, decode_slots)
        if self.decode_kernel == "cpu" and (decode_rows or chunks):
            from forklm.kernels.cpu_attention import plan_items

            self._cpu_chunk_items(plan, chunks)
            plan.kernel_plan = plan_items(plan.kernel_items, row, bs)
        return plan

    def _advance(self, plan: StepPlan, rows: Sequence[DecodeRow], slots: list[int]) -> bool:
        """Takes the last step's decode plan forward by one token per row, if the rows are the
        same (same keys and block tables, in the same order, each one token further, shareable
        prefixes fixed). A row whose new slot continues its last run grows that run; one whose
        slot starts elsewhere gets a new run if it has a tail group of its own. Otherwise (a row
        of a multi-row group left its lane) it returns False and the plan is rebuilt."""
        last = self._last
        if last is None or len(rows) != len(last.keys) or self.decode_kernel != "torch":
            return False
        bs = self.block_size
        jumps = []  # rows whose new slot does not follow their previous one
        for i, (r, key, table, pos, slot, prev) in enumerate(
            zip(rows, last.keys, last.tables, last.positions, slots, last.slots)
        ):
            sb = r.shareable_blocks
            if r.key is not key or key is None or r.block_table is not table or r.position != pos + 1 \
                    or sb is None or sb * bs > pos:
                return False
            if slot != prev + 1:
                jumps.append(i)
        tails = last.tails
        if any(tails[last.group_of[i]].num_rows != 1 for i in jumps):
            return False
        for tg in tails:  # a ragged group's longest read grows by one slot: it must stay in the pool
            if tg.lengths is not None:
                end = tg.runs[-1]
                if tg.rows_per_unit != 1 or end.first_slot + (tg.num_units - 1) * end.stride + end.length >= self.num_slots:
                    return False
        for tg in tails:
            tg.runs[-1].length += 1
            if tg.lengths is not None:
                tg.lengths = [n + 1 for n in tg.lengths]
        for i in jumps:  # the run just grown was wrong for these: the new token is a run of its own
            runs = tails[last.group_of[i]].runs
            runs[-1].length -= 1
            runs.append(StridedRun(slots[i], 0, 1))
        last.positions = [r.position for r in rows]
        last.slots = slots
        plan.tails, plan.extra, plan.order, plan.num_shared_reads = tails, last.extra, last.order, last.num_shared_reads
        return True

    # ------------------------------------------------------------------ decode rows
    def _plan_decode(self, plan: StepPlan, rows: Sequence[DecodeRow], slots: list[int]) -> None:
        self._last = None
        caches, prefixes = self._row_prefixes(rows)
        segments, tail_start = self._shared(rows, prefixes)
        if self.shared_attention == "standard" and self.decode_kernel != "torch":
            # the kernels read a segment once for its rows whenever one is planned: standard
            # attention plans none, so each row reads its whole cache itself
            segments, tail_start = [], [0] * len(rows)
        if self.decode_kernel == "cpu":  # items in the rows' own order: the C++ kernel needs no plan order
            self._cpu_plan(plan, rows, segments, tail_start)
            return
        tails = self._tail_runs(rows, caches, tail_start)
        ragged = self.num_slots is not None and self.decode_kernel == "torch"
        units = self._ordered_units(rows, prefixes, tails, ragged)
        order = [i for u in units for i in u]
        position_of = [0] * len(rows)  # decode row -> plan row
        for pos, i in enumerate(order):
            position_of[i] = pos
        if order != list(range(len(rows))):
            plan.order = torch.tensor(order, dtype=torch.long, device=self.device)
        if self.decode_kernel == "triton":
            self._kernel_plan(plan, rows, order, position_of, segments, tail_start)
            return
        groups = self._tail_groups(units, tails, ragged)
        plan.tails = groups
        group_of = [0] * len(rows)
        for gi, tg in enumerate(groups):
            for pos in range(tg.row0, tg.row0 + tg.num_rows):
                group_of[order[pos]] = gi
        plan.extra = extra = self._segment_reads(plan, segments, position_of)
        if all(r.key is not None for r in rows):
            self._last = _DecodePlanState(
                list(map(operator.attrgetter("key"), rows)), [r.block_table for r in rows],
                [r.position for r in rows], slots, group_of, groups, extra, plan.order, plan.num_shared_reads,
            )

    def _row_prefixes(self, rows: Sequence[DecodeRow]) -> tuple[list[TailRuns | None], list[tuple[int, ...]]]:
        """Each row's cached tail (None: an unkeyed row) and shareable prefix: its leading full
        blocks, at most `shareable_blocks` of them."""
        bs = self.block_size
        caches: list[TailRuns | None] = []
        prefixes = []
        for r in rows:  # a row's blocks are only ever appended to: its cached prefix stays valid
            n = min(r.position // bs, r.shareable_blocks if r.shareable_blocks is not None else 1 << 62)
            cache = None
            if r.key is not None:
                cache = self._tails.get(r.key)
                if cache is None:
                    cache = self._tails[r.key] = TailRuns()
                if len(cache.prefix) != n:
                    cache.prefix = tuple(r.block_table[:n])
                prefixes.append(cache.prefix)
            else:
                prefixes.append(tuple(r.block_table[:n]))
            caches.append(cache)
        return caches, prefixes

    def _tail_runs(self, rows: Sequence[DecodeRow], caches: list[TailRuns | None], tail_start: list[int]) -> list[Runs]:
        """Each row's tail (from its first block past the shared segments through its new token)
        as runs of slots; cached tails of rows that left without `forget` are dropped."""
        bs = self.block_size
        tails = []
        live = set()
        for i, (r, cache) in enumerate(zip(rows, caches)):
            start, end = tail_start[i] * bs, r.position + 1
            if cache is None:
                tails.append(slot_runs(r.block_table, start, end, bs))
            else:
                live.add(r.key)
                tails.append(cache.update(r.block_table, start, end, bs))
        if len(self._tails) > 4 * max(len(live), 64):  # rows that left without `forget`
            self._tails = {k: v for k, v in self._tails.items() if k in live}
        return tails

    @staticmethod
    def _ordered_units(rows: Sequence[DecodeRow], prefixes: list[tuple[int, ...]], tails: list[Runs],
                       ragged: bool) -> list[list[int]]:
        """The rows' units (lists of decode rows planned together) in plan order."""
        units = _units(rows, prefixes, tails) if ragged else [[i] for i in range(len(rows))]
        # Plan order: by shareable prefix (rows of a shared segment become a contiguous range),
        # then tails by their shape and first slot so strided lane groups line up (units keep
        # their rows together, in position order).
        if ragged:
            units.sort(key=lambda u: (prefixes[u[0]], len(tails[u[0]]), [n for _, n in tails[u[0]][:-1]], len(u),
                                      tails[u[0]][0][0], tails[u[0]][-1][1]))
        else:
            units.sort(key=lambda u: (prefixes[u[0]], [n for _, n in tails[u[0]]], tails[u[0]][0][0]))
        return units

    def _tail_groups(self, units: list[list[int]], tails: list[Runs], ragged: bool) -> list[TailGroup]:
        """Tails: neighbouring units whose runs line up at constant strides (their lengths equal,
        or, with masked reads, the last run's lengths ragged), in plan order."""
        groups: list[TailGroup] = []
        pos = 0
        for u in units:
            lengths = [tails[i][-1][1] for i in u]
            runs = tails[u[-1]]  # the unit's longest row
            last = groups[-1] if groups else None
            if last is not None and _extends(last, runs, lengths, ragged, self.num_slots):
                if last.num_units == 1:
                    for sr, (first, _) in zip(last.runs, runs):
                        sr.stride = first - sr.first_slot
                if last.lengths is None and (ragged and (len(u) > 1 or lengths[-1] != last.runs[-1].length)):
                    last.lengths = [last.runs[-1].length] * last.num_rows
                if last.lengths is not None:
                    last.lengths.extend(lengths)
                    last.runs[-1].length = max(last.runs[-1].length, lengths[-1])
                last.num_rows += len(u)
            else:
                tg = TailGroup(pos, len(u), [StridedRun(first, 0, n) for first, n in runs], len(u))
                if len(u) > 1:
                    tg.lengths = lengths
                groups.append(tg)
            pos += len(u)
        return groups

    def _segment_reads(self, plan: StepPlan, segments: list[SharedSegment], position_of: list[int]) -> list[ExtraRead]:
        """The shared segments' reads, each over its rows' contiguous range of plan rows,
        bifurcated or expanded (`shared_attention`, "auto": by `choose_decode_path`); counts the
        bifurcated ones in `plan.num_shared_reads`."""
        bs = self.block_size
        extra: list[ExtraRead] = []
        for seg in segments:
            plan_rows = sorted(position_of[r] for r in seg.rows)
            r0, r1 = plan_rows[0], plan_rows[-1] + 1
            assert r1 - r0 == len(plan_rows), "rows of a shared segment are contiguous in plan order"
            tokens = len(seg.blocks) * bs
            if self.shared_attention == "auto":
                bif = choose_decode_path(self.device.type, len(plan_rows), tokens, 0) == "bifurcated"
            else:
                bif = self.shared_attention == "bifurcated"
            for first, n in slot_runs(seg.blocks, 0, tokens, bs):
                extra.append(ExtraRead(r0, r1, first, n, bif))
            plan.num_shared_reads += bif
        return extra

    def _shared(self, rows: Sequence[DecodeRow], prefixes: list[tuple]) -> tuple[list[SharedSegment], list[int]]:
        key = tuple((r.key, len(p)) for r, p in zip(rows, prefixes)) if all(r.key is not None for r in rows) else None
        if key is not None and key == self._segments_key:
            return self._segments
        result = shared_segments(prefixes)
        self._segments_key, self._segments = key, result
        return result

    def _cpu_plan(self, plan: StepPlan, rows: Sequence[DecodeRow], segments: list[SharedSegment],
                  tail_start: list[int]) -> None:
        from forklm.kernels.segment_attention import SegmentItem

        bs = self.block_size
        items = [SegmentItem(seg.rows, seg.blocks, len(seg.blocks) * bs) for seg in segments]
        for i, r in enumerate(rows):  # each row's tail: its own blocks, current token included
            t = r.position
            items.append(SegmentItem((i,), r.block_table[tail_start[i] : t // bs + 1], t + 1 - tail_start[i] * bs))
        plan.kernel_items = items  # `plan` makes them the kernel's tables, the chunks' items added
        plan.extra = [ExtraRead(min(seg.rows), max(seg.rows) + 1, -1, 0, True) for seg in segments]
        plan.num_shared_reads = len(segments)

    def _cpu_chunk_items(self, plan: StepPlan, chunks: Sequence[tuple[Sequence[int], int, int]]) -> None:
        """The C++ kernel's items for the step's prefill chunks, after the decode rows': a chunk's rows
        in block b read blocks [0, b) of their table as one item (the prompt before them, read once for
        the block's rows) and their own block up to themselves, so a prompt token attends in the
        kernel's fixed order as a decode row at its position would, whatever the chunking, the cache
        hits and the rows around it (the kernel writes the chunk's K/V before it attends)."""
        from forklm.kernels.segment_attention import SegmentItem

        bs = self.block_size
        items = plan.kernel_items
        for ch, (table, s0, s1) in zip(plan.chunks, chunks, strict=True):
            for b in range(s0 // bs, (s1 - 1) // bs + 1):
                first, last = max(s0, b * bs), min(s1, (b + 1) * bs)  # the chunk's positions in block b
                rows = range(ch.row_start + first - s0, ch.row_start + last - s0)
                if b:
                    items.append(SegmentItem(rows, table[:b], b * bs))
                items.extend(SegmentItem((r,), (table[b],), pos - b * bs + 1) for r, pos in zip(rows, range(first, last)))

    def _kernel_plan(self, plan, rows, order, position_of, segments, tail_start) -> None:
        from forklm.kernels.segment_attention import SegmentItem, plan_segments

        bs = self.block_size
        items = [SegmentItem([position_of[r] for r in seg.rows], seg.blocks, len(seg.blocks) * bs) for seg in segments]
        for pos, i in enumerate(order):  # each row's tail: its own blocks, current token included
            r = rows[i]
            t = r.position
            items.append(SegmentItem([pos], r.block_table[tail_start[i] : t // bs + 1], t + 1 - tail_start[i] * bs))
        plan.kernel_plan = plan_segments(items, len(rows), self.num_heads, self.num_kv_heads, bs, self.device)
        plan.extra = [
            ExtraRead(min(position_of[r] for r in seg.rows), max(position_of[r] for r in seg.rows) + 1, -1, 0, True)
            for seg in segments
        ]
        plan.num_shared_reads = len(segments)


def _units(rows: Sequence[DecodeRow], prefixes: list[tuple], tails: list[Runs]) -> list[list[int]]:
    """Rows in units: the consecutive rows of one multi-token extend (same block table, positions
    one apart, the same tail runs but the last one's length) form one; any other row is its own."""
    units: list[list[int]] = []
    for i, r in enumerate(rows):
        if units:
            j = units[-1][-1]
            prev, a, b = rows[j], tails[j], tails[i]
            if r.block_table is prev.block_table and r.position == prev.position + 1 and prefixes[i] == prefixes[j] \
                    and len(a) == len(b) and a[:-1] == b[:-1] and a[-1][0] == b[-1][0]:
                units[-1].append(i)
                continue
        units.append([i])
    return units


def _extends(group: TailGroup, runs: Runs, lengths: list[int], ragged: bool, num_slots: int | None) -> bool:
    """Whether a unit with these tail runs (its longest row's) and last-run lengths (per row)
    continues `group`: as many rows, runs at constant strides, equal run lengths but, with
    masked reads (`ragged`), the last one's, whose longest read stays inside the pool and at
    most doubles what the shortest row needs."""
    if len(runs) != len(group.runs) or len(lengths) != group.rows_per_unit:
        return False
    k = group.num_units
    last = len(runs) - 1
    for j, (sr, (first, n)) in enumerate(zip(group.runs, runs)):
        if n != sr.length and not (ragged and j == last):
            return False
        if k == 1:
            if first <= sr.first_slot:
                return False
        elif first != sr.first_slot + k * sr.stride:
            return False
    if ragged and (group.lengths is not None or len(lengths) > 1 or lengths[-1] != group.runs[-1].length):
        longest = max(group.runs[-1].length, lengths[-1])
        shortest = min(lengths[0], min(group.lengths) if group.lengths is not None else group.runs[-1].length)
        if runs[-1][0] + longest > num_slots or longest > 2 * shortest + 8:
            return False
        return True
    if k == 1:  # every run must step by a stride of its own that keeps the rows apart
        return all(first - sr.first_slot >= sr.length for sr, (first, _) in zip(group.runs, runs))
    return True


def build_step_plan(
    decode_rows: list[tuple[list[int], int]],  # (block_table, num_computed): the token at num_computed is new
    chunks: list[tuple[list[int], int, int]],  # (block_table, s0, s1): tokens [s0, s1) are new
    block_size: int,
    shared_attention: str,  # "auto" | "bifurcated" | "standard"
    device: torch.device,
    mask_dtype: torch.dtype | None = None,  # unused (no padded batches any more); kept for callers
    decode_kernel: str = "torch",
    num_heads: int = 0,
    num_kv_heads: int = 0,
) -> StepPlan:
    """A one-off plan (no caching across steps): every full block may be shared."""
    planner = StepPlanner(block_size, shared_attention, device, decode_kernel, num_heads, num_kv_heads)
    return planner.plan([DecodeRow(table, t) for table, t in decode_rows], chunks)


class PagedAttention:
    def __init__(self, kv: PagedKVCache, plan: StepPlan) -> None:
        self.kv = kv
        self.plan = plan
        self._masks: dict[int, torch.Tensor] = {}  # tail group index -> its mask (the same in every layer)

    @property
    def fuses_rope(self) -> bool:
        """Whether `attend_qkv` runs this step: every row (decode rows and prefill chunks alike) on
        the CPU kernel (never on a latent pool, whose V is its K: the fused kernel writes both)."""
        return isinstance(self.plan.kernel_plan, CpuAttentionPlan) and not self.kv.shares_values

    def attend_qkv(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Rotary, K/V write and attention in one call (`fuses_rope` steps): qkv [T, (h + 2g)·D] float32
        (the q/k/v product's rows), cos / sin_signed [T, 1, D] -> [T, h·D]."""
        from forklm.kernels.cpu_attention import paged_attention

        K, V = self.kv.k[layer], self.kv.v[layer]
        h = qkv.shape[1] // K.shape[-1] - 2 * K.shape[0]
        return paged_attention(qkv, K, V, self.plan.kernel_plan, h, rope=(cos, sin_signed, self.plan.write_slots))

    def run_layers(self, stack, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """Every layer of a `fuses_rope` step in one call (`stack`: kernels/decode_stack.py's C++
        DecodeStack), with this step's caches and plan: x [T, H] float32 -> [T, H]."""
        from forklm.kernels.cpu_attention import CHUNK_TOKENS

        p = self.plan.kernel_plan
        scale = 1.0 / math.sqrt(self.kv.k[0].shape[-1])
        return stack.forward(x, self.kv.k, self.kv.v, cos, sin_signed, self.plan.write_slots, p.num_rows, p.rows_start,
                             p.rows, p.blocks_start, p.blocks, p.tokens, p.block_size, scale, CHUNK_TOKENS)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None) -> torch.Tensor:
        """q [T, h, D], the new tokens' k / v [T, g, D] (written to the pool first) -> [T, h, D];
        scale: the softmax's (default 1/sqrt(D))."""
        plan = self.plan
        T, h, D = q.shape
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        self.kv.write(layer, plan.write_slots, k, v)
        if isinstance(plan.kernel_plan, CpuAttentionPlan):  # every row, the chunks' too, in one C++ call
            from forklm.kernels.cpu_attention import paged_attention

            # float32 arithmetic whatever the model's dtype (a bfloat16 model's queries widened exactly)
            o = paged_attention(q.float(), self.kv.k[layer], self.kv.v[layer], plan.kernel_plan, h, scale)
            return o.view(T, h, D).to(q.dtype)
        parts = []
        B = plan.num_decode
        if B:
            qd = q[:B] if plan.order is None else q[:B].index_select(0, plan.order)
            o = self._decode(layer, qd, k.shape[1], scale)
            if plan.order is not None:
                o = torch.empty_like(o).index_copy_(0, plan.order, o)
            parts.append(o)
        for ch in plan.chunks:
            r0, r1 = ch.row_start, ch.row_start + ch.num_tokens
            parts.append(self._prefill(layer, q[r0:r1], k[r0:r1], v[r0:r1], ch.prefix_runs, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, v_dim: int,
                      scale: float) -> torch.Tensor:
        """Absorbed multi-head latent attention (models/deepseek.py): q [T, h, Dk], the new tokens'
        latents [T, Dk] -> [T, h, v_dim]. The pool holds one latent per token and layer (a single KV
        head, `kv_shares_values`); attention over it is multi-query attention whose values are the
        latents themselves, so every step's plan applies unchanged (a shared prompt's latents read
        once for all rows · h query heads when bifurcated) and the output's first v_dim dims are the
        weighted sums of the latents' first v_dim (the rest, the rotary dims' sums, is dropped)."""
        kv = latent.unsqueeze(1)  # [T, 1, Dk]
        return self.attend(layer, q, kv, kv, scale)[..., :v_dim]

    def attend_el(self, layer: int, x: torch.Tensor, q: torch.Tensor, expand, unexpand, kv_of, g: int,
                  scale: float) -> torch.Tensor:
        """EL-attention (models/gpt2.py): the pool holds each token's attention input x (one
        hidden_size-wide "KV head", V is K). x [T, Dm] (written to the pool), q [T, h, D] -> [T, h, D].
        Decode rows attend over the hidden states with their queries expanded through W_K
        (`expand`: [B, h, D] -> [B, h, Dm]), the weighted sums taken through W_V after
        (`unexpand`: [B, h, Dm] -> [B, h, D]): multi-query attention over the pool, so the step's
        plan applies unchanged (a shared prompt read once for all rows · h heads when bifurcated).
        A prefill chunk attends over keys and values recomputed from its prefix's hidden states
        (`kv_of`: [S, Dm] -> k, v [S, g, D], g KV heads) or, when that costs more (a short chunk
        after a long prefix: a prompt's last tokens after a cache hit), with its queries expanded."""
        plan = self.plan
        xs = x.unsqueeze(1)
        self.kv.write(layer, plan.write_slots, xs, xs)
        parts = []
        B = plan.num_decode
        if B:
            qd = q[:B] if plan.order is None else q[:B].index_select(0, plan.order)
            o = unexpand(self._decode(layer, expand(qd), 1, scale))
            if plan.order is not None:
                o = torch.empty_like(o).index_copy_(0, plan.order, o)
            parts.append(o)
        X = self.kv.k[layer][0]  # [slots, Dm]
        D = q.shape[2]
        for ch in plan.chunks:
            r0, r1 = ch.row_start, ch.row_start + ch.num_tokens
            # Per prefix token, recomputing its k / v costs 2·Dm·2gD flops; expanding the chunk's queries
            # instead costs 2·c·h·Dm for the scores and as much for the sums: the cheaper way for this chunk.
            if ch.prefix_runs and ch.num_tokens * q.shape[1] < g * D:
                xc = xs[r0:r1]
                parts.append(unexpand(self._prefill(layer, expand(q[r0:r1]), xc, xc, ch.prefix_runs, scale)))
                continue
            x_own = x[r0:r1] if X.dtype == x.dtype else x[r0:r1].to(X.dtype).to(x.dtype)  # as the pool holds it
            k, v = kv_of(x_own)
            segments = []
            if ch.prefix_runs:
                kp, vp = kv_of(torch.cat([X[f : f + n] for f, n in ch.prefix_runs]).to(x.dtype))
                segments = [(kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0))]
            parts.append(self._causal_and_segments(q[r0:r1], k, v, segments, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    # ------------------------------------------------------------------ decode rows
    def _decode(self, layer: int, q: torch.Tensor, g: int, scale: float) -> torch.Tensor:
        """q [B, h, D] in plan order -> [B, h, D]."""
        plan = self.plan
        B, h, D = q.shape
        if isinstance(plan.kernel_plan, CpuAttentionPlan):  # one C++ call (rows in their own order)
            from forklm.kernels.cpu_attention import paged_attention

            # float32 arithmetic whatever the model's dtype (a bfloat16 model's queries widened exactly)
            o = paged_attention(q.float(), self.kv.k[layer], self.kv.v[layer], plan.kernel_plan, h, scale).view(B, h, D)
            return o.to(q.dtype)
        if plan.kernel_plan is not None:  # every segment and tail in one kernel, merged exactly
            from forklm.kernels.segment_attention import segment_attention

            o, _ = segment_attention(q, self.kv.k[layer], self.kv.v[layer], plan.kernel_plan, scale)
            return o
        outs, lses, later = self._attend_tails(layer, q, g, scale)
        o = outs[0] if len(outs) == 1 else torch.cat(outs)
        if not plan.extra and not later:
            return o
        lse = lses[0] if len(lses) == 1 else torch.cat(lses)
        o = o.float()
        for r0, s, o_s, lse_s in later:
            o_m, lse_m = merge_partials(o[r0 : r0 + s], lse[r0 : r0 + s], o_s, lse_s)
            o[r0 : r0 + s] = o_m
            lse[r0 : r0 + s] = lse_m
        o, lse = self._attend_extra(layer, q, g, scale, o, lse)
        return o.to(q.dtype)

    def _attend_tails(self, layer: int, q: torch.Tensor, g: int, scale: float):
        """PyTorch's path over the plan's tail groups: (outputs [rows, h, D] and log-sum-exps [rows, h]
        of each group's first run, in row order; (row0, rows, o, lse) of their later runs, to merge)."""
        B, h, D = q.shape
        p = h // g
        K, V = self.kv.k[layer], self.kv.v[layer]  # [g, slots, D]
        outs, lses, later = [], [], []
        for ti, tg in enumerate(self.plan.tails):
            s, r, rows = tg.num_units, tg.rows_per_unit, tg.num_rows
            if r == 1:
                qg = q[tg.row0 : tg.row0 + s].view(s, g, p, D)
            else:  # a unit's r rows as r·p query rows per KV head: [s, g, r·p, D]
                qg = q[tg.row0 : tg.row0 + rows].view(s, r, g, p, D).transpose(1, 2).reshape(s, g, r * p, D)
            mask = self._tail_mask(ti, tg, p, q.dtype) if tg.lengths is not None else None
            for j, sr in enumerate(tg.runs):
                size = (s, g, sr.length, D)
                strides = (sr.stride * D, K.stride(0), D, 1)
                kt = K.as_strided(size, strides, K.storage_offset() + sr.first_slot * D)
                vt = V.as_strided(size, strides, V.storage_offset() + sr.first_slot * D)
                o_t, lse_t = attend_segment(qg, kt, vt, scale, attn_mask=mask if j == len(tg.runs) - 1 else None)
                if r == 1:
                    o_t, lse_t = o_t.reshape(s, h, D), lse_t.reshape(s, h)
                else:
                    o_t = o_t.view(s, g, r, p, D).transpose(1, 2).reshape(rows, h, D)
                    lse_t = lse_t.view(s, g, r, p).transpose(1, 2).reshape(rows, h)
                if j == 0:
                    outs.append(o_t)
                    lses.append(lse_t)
                else:
                    later.append((tg.row0, rows, o_t, lse_t))
        return outs, lses, later

    def _attend_extra(self, layer: int, q: torch.Tensor, g: int, scale: float, o: torch.Tensor,
                      lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's extra segments (shared prefixes: one product for all their rows when bifurcated,
        else each row on its own), merged into o [B, h, D] float32 and lse [B, h]."""
        B, h, D = q.shape
        p = h // g
        K, V = self.kv.k[layer], self.kv.v[layer]  # [g, slots, D]
        for e in self.plan.extra:
            s = e.row1 - e.row0
            qs = q[e.row0 : e.row1]
            ks = K[:, e.first_slot : e.first_slot + e.length].unsqueeze(0)  # [1, g, S, D]
            vs = V[:, e.first_slot : e.first_slot + e.length].unsqueeze(0)
            if e.bifurcated:
                q_rows = qs.view(s, g, p, D).transpose(0, 1).reshape(1, g, s * p, D)
                o_s, lse_s = attend_segment(q_rows, ks, vs, scale)
                o_s = o_s.view(g, s, p, D).transpose(0, 1).reshape(s, h, D)
                lse_s = lse_s.view(g, s, p).transpose(0, 1).reshape(s, h)
            else:
                S = e.length
                o_s, lse_s = attend_segment(qs.view(s, g, p, D), ks.expand(s, g, S, D), vs.expand(s, g, S, D), scale)
                o_s, lse_s = o_s.reshape(s, h, D), lse_s.reshape(s, h)
            if s == B:
                o, lse = merge_partials(o, lse, o_s, lse_s)
            else:
                o_m, lse_m = merge_partials(o[e.row0 : e.row1], lse[e.row0 : e.row1], o_s, lse_s)
                o[e.row0 : e.row1] = o_m
                lse[e.row0 : e.row1] = lse_m
        return o, lse

    def _tail_mask(self, index: int, tg: TailGroup, p: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [units, 1, r·p, L] (0 or -inf) of a ragged tail group's last run: query
        row (j, head i) of unit u sees the first lengths[u·r + j] slots. Built once per step."""
        mask = self._masks.get(index)
        if mask is None:
            s, r, L = tg.num_units, tg.rows_per_unit, tg.runs[-1].length
            lengths = torch.tensor(tg.lengths, device=self.kv.device).view(s, r, 1, 1)
            hidden = torch.arange(L, device=self.kv.device) >= lengths  # [s, r, 1, L]
            mask = torch.zeros(s, r, p, L, dtype=dtype, device=self.kv.device)
            mask.masked_fill_(hidden, float("-inf"))
            mask = self._masks[index] = mask.view(s, 1, r * p, L)
        return mask

    # ------------------------------------------------------------------ prefill chunks
    def _prefill(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: Runs, scale: float
    ) -> torch.Tensor:
        K, V = self.kv.k[layer], self.kv.v[layer]
        if K.dtype != q.dtype:  # a float16 cache: the chunk sees its own K/V as the cache holds them
            k, v = k.to(K.dtype).to(q.dtype), v.to(K.dtype).to(q.dtype)
        # the earlier tokens' runs, read in place (float16 cache: a float copy of the run, prefill only)
        segments = ((K[:, first : first + n].unsqueeze(0).to(q.dtype), V[:, first : first + n].unsqueeze(0).to(q.dtype))
                    for first, n in prefix)
        return self._causal_and_segments(q, k, v, segments, scale)

    @staticmethod
    def _causal_and_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments, scale: float) -> torch.Tensor:
        """q [T, h, D] causally over its own k / v [T, g, D], then over each earlier segment (ks, vs
        [1, g, S, D]), merged by log-sum-exp -> [T, h, D]."""
        T, h, D = q.shape
        g = k.shape[1]
        p = h // g
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, h, T, D]
        kh = k.transpose(0, 1).repeat_interleave(p, dim=0).unsqueeze(0)
        vh = v.transpose(0, 1).repeat_interleave(p, dim=0).unsqueeze(0)
        o, lse = attend_segment(qh, kh, vh, scale, causal=True)  # [1, h, T, D], [1, h, T]
        segments = list(segments)
        if not segments:
            return o[0].transpose(0, 1)
        o = o.float()  # merged in float32, rounded once at the end
        # All T·p query rows of a KV head against the earlier tokens, segment by segment.
        q_rows = q.view(T, g, p, D).permute(1, 0, 2, 3).reshape(1, g, T * p, D)
        for ks, vs in segments:
            o_p, lse_p = attend_segment(q_rows, ks, vs, scale)
            o_p = o_p.view(g, T, p, D).permute(0, 2, 1, 3).reshape(1, h, T, D)
            lse_p = lse_p.view(g, T, p).permute(0, 2, 1).reshape(1, h, T)
            o, lse = merge_partials(o, lse, o_p, lse_p)
        return o[0].transpose(0, 1).to(q.dtype)  # [T, h, D]
