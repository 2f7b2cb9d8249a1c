"""Shared-prefix trie and paged attention (decode rows + prefill chunks) against a plain reference."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zlib

from forklm.attention.paged import DecodeRow, PagedAttention, StepPlanner, build_step_plan
from forklm.attention.shared_prefix import shared_segments
from forklm.cache.paged_kv import PagedKVCache, slot_runs, slots_of
from forklm.config import ModelConfig

from conftest import rel_err

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------------- the trie
def test_shared_segments_example():
    tables = [
        [1, 2, 3, 10],  # system [1,2] -> prompt [3] -> own [10]
        [1, 2, 3, 11],
        [1, 2, 4],
        [5, 6],  # shares nothing
        [1, 2, 3],  # ends where the others' own tokens start
    ]
    segments, tail = shared_segments(tables)
    assert [(s.rows, s.blocks, s.start_block) for s in segments] == [
        ((0, 1, 2, 4), (1, 2), 0),
        ((0, 1, 4), (3,), 2),
    ]
    assert tail == [3, 3, 2, 0, 3]


def test_shared_segments_no_sharing_and_empty():
    assert shared_segments([]) == ([], [])
    segs, tail = shared_segments([[1, 2], [3], []])
    assert segs == [] and tail == [0, 0, 0]


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@st.composite
def tree_tables(draw):
    """Block tables of rows that share prefixes like a tree (distinct ids per tree node)."""
    next_id = iter(range(10_000))
    rows = []

    def grow(prefix, depth):
        kids = draw(st.integers(1, 3)) if depth < 3 else 1
        for _ in range(kids):
            own = [next(next_id) for _ in range(draw(st.integers(0, 3)))]
            if depth < 3 and draw(st.booleans()):
                grow(prefix + own, depth + 1)
            else:
                rows.append(prefix + own)

    grow([], 0)
    return draw(st.permutations(rows))


@settings(max_examples=200, deadline=None)
@given(tree_tables())
def test_shared_segments_properties(tables):
    segments, tail = shared_segments(tables)
    covered = {r: [] for r in range(len(tables))}
    for seg in segments:
        assert len(seg.rows) >= 2 and seg.blocks
        for r in seg.rows:
            t = tables[r]
            assert tuple(t[seg.start_block : seg.start_block + len(seg.blocks)]) == seg.blocks
            covered[r].append((seg.start_block, seg.start_block + len(seg.blocks)))
    for r, spans in covered.items():
        spans.sort()
        end = 0
        for a, b in spans:
            assert a == end, f"row {r}: segments leave a gap or overlap at block {end}"
            end = b
        assert end == tail[r]
    # Maximal: two rows share a segment reaching exactly their common prefix.
    for r in range(len(tables)):
        for s in range(r + 1, len(tables)):
            both = [seg.start_block + len(seg.blocks) for seg in segments if r in seg.rows and s in seg.rows]
            assert max(both, default=0) == _lcp(tables[r], tables[s])


# ---------------------------------------------------------------------- attention
def _config(h, g, D):
    return ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": h * D,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": h,
            "num_key_value_heads": g,
            "vocab_size": 32,
            "max_position_embeddings": 4096,
        }
    )


def _reference(q, K, V, causal_offset=None):
    """q [T, h, D], K/V [S, g, D] -> [T, h, D]; row t sees keys 0..causal_offset+t (all if None)."""
    T, h, D = q.shape
    p = h // K.shape[1]
    Kh, Vh = K.repeat_interleave(p, dim=1).double(), V.repeat_interleave(p, dim=1).double()
    s = torch.einsum("thd,shd->hts", q.double(), Kh) / math.sqrt(D)
    if causal_offset is not None:
        S = K.shape[0]
        allowed = torch.arange(S).unsqueeze(0) <= causal_offset + torch.arange(T).unsqueeze(1)
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hts,shd->thd", torch.softmax(s, -1), Vh)


def _random_tree_workload(gen: random.Random, bs: int, num_blocks: int, fragmented: bool):
    """Block tables for: a system prompt shared by all requests, per-request prompts shared by
    their samples, each sample's own tokens; plus one sequence mid-prefill. Block ids are handed
    out in order or shuffled (a fragmented pool)."""
    ids = list(range(num_blocks))
    if fragmented:
        gen.shuffle(ids)
    free = iter(ids)
    system = [next(free) for _ in range(gen.randint(0, 6))]
    rows = []
    for i in range(gen.randint(2, 4)):
        prompt = system + [next(free) for _ in range(gen.randint(1, 4))]
        for _ in range(gen.randint(2 if i == 0 else 1, 5)):
            extra = gen.randint(1, 3 * bs)  # own tokens incl. the new one, partial last block
            table = prompt + [next(free) for _ in range(-(-extra // bs))]
            rows.append((table, len(prompt) * bs + extra - 1))
    chunk_table = system + [next(free) for _ in range(5)]
    s0 = gen.randint(0, len(chunk_table) * bs - 2)
    s1 = gen.randint(s0 + 1, min(len(chunk_table) * bs, s0 + 3 * bs))
    return rows, [(chunk_table, s0, s1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,g", [(4, 4), (9, 3), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("fragmented", [False, True])
@pytest.mark.parametrize("mode", ["auto", "bifurcated", "standard"])
def test_paged_attention_matches_reference(dtype, h, g, fragmented, mode):
    seed = zlib.crc32(repr((str(dtype), h, g, fragmented, mode)).encode())
    gen = random.Random(seed)
    tgen = torch.Generator().manual_seed(seed)
    bs, D, num_blocks = 8, 16, 160
    cfg = _config(h, g, D)
    kv = PagedKVCache(cfg, num_blocks, bs, dtype, torch.device("cpu"))
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=tgen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=tgen))
    rows, chunks = _random_tree_workload(gen, bs, num_blocks, fragmented)
    T = len(rows) + sum(s1 - s0 for _, s0, s1 in chunks)
    q = torch.randn(T, h, D, generator=tgen).to(dtype)
    k = torch.randn(T, g, D, generator=tgen).to(dtype)
    v = torch.randn(T, g, D, generator=tgen).to(dtype)
    plan = build_step_plan(rows, chunks, bs, mode, torch.device("cpu"), dtype)
    if mode == "bifurcated":
        assert plan.segments and all(s.bifurcated for s in plan.segments)  # request 0 has >= 2 samples
    if mode == "standard":
        assert not any(s.bifurcated for s in plan.segments)
    out = PagedAttention(kv, plan).attend(0, q, k, v)
    assert out.shape == (T, h, D) and out.dtype == dtype
    # The new K/V went to their slots.
    assert torch.equal(kv.k[0][:, plan.write_slots].transpose(0, 1), k)
    K, V = kv.k[0], kv.v[0]  # [g, slots, D]
    refs = []
    for r, (table, t) in enumerate(rows):
        s = slots_of(table, 0, t + 1, bs)
        refs.append(_reference(q[r : r + 1], K[:, s].transpose(0, 1), V[:, s].transpose(0, 1)))
    row = len(rows)
    for table, s0, s1 in chunks:
        s = slots_of(table, 0, s1, bs)
        refs.append(_reference(q[row : row + s1 - s0], K[:, s].transpose(0, 1), V[:, s].transpose(0, 1), s0))
        row += s1 - s0
    ref = torch.cat(refs)
    assert rel_err(out, ref) < TOL[dtype]
    # Per row too: a wrong row cannot hide in the overall norm.
    per_row = ((out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max().item()
    assert per_row < 5 * TOL[dtype]


def test_reference_catches_a_missing_token():
    """The comparison above can fail: dropping one key of a row changes its output."""
    tgen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 16, generator=tgen)
    K = torch.randn(20, 2, 16, generator=tgen)
    V = torch.randn(20, 2, 16, generator=tgen)
    assert rel_err(_reference(q, K[:19], V[:19]), _reference(q, K, V)) > 1e-3


def test_slot_runs():
    table = [9, 3, 7, 1, 5, 0]  # no two consecutive ids: one run per block
    assert len(slot_runs(table, 0, 6 * 4, 4)) == 6
    assert slot_runs([2, 3, 4, 8], 1, 14, 4) == [(9, 11), (32, 2)]


def _check_rows(kv, rows, out, q, bs, tol):
    K, V = kv.k[0], kv.v[0]
    for r, (table, t) in enumerate(rows):
        s = slots_of(table, 0, t + 1, bs)
        ref = _reference(q[r : r + 1], K[:, s].transpose(0, 1), V[:, s].transpose(0, 1))
        assert rel_err(out[r : r + 1], ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lane_groups_are_one_strided_read(dtype):
    """Samples whose own blocks are a strided lane group (sample i owns blocks base + i*K ..):
    their tails are one view and one product, whatever order the rows come in, and rows of
    another length or a scattered tail get their own reads; outputs equal the reference."""
    gen = torch.Generator().manual_seed(11)
    bs, h, g, D, n, K_blocks = 4, 6, 2, 16, 5, 3
    kv = PagedKVCache(_config(h, g, D), 64, bs, dtype, torch.device("cpu"))
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    prompt = [0, 1, 2]  # 12 shared prompt tokens
    base = 10
    lane = [(prompt + [base + i * K_blocks + j for j in range(K_blocks)], 12 + 6) for i in range(n)]
    other = [(prompt + [40, 41], 12 + 5), ([50, 52, 51], 9)]  # shorter sample; a distinct, scattered row
    rows = [lane[3], other[0], lane[0], lane[4], other[1], lane[1], lane[2]]
    planner = StepPlanner(bs, "auto", torch.device("cpu"))
    plan = planner.plan([DecodeRow(t, p, key=i) for i, (t, p) in enumerate(rows)], [])
    assert [tg.num_rows for tg in plan.tails if tg.num_rows > 1] == [n]
    lane_group = next(tg for tg in plan.tails if tg.num_rows == n)
    assert [r.stride for r in lane_group.runs] == [K_blocks * bs] and lane_group.length == 7
    assert plan.segments and plan.segments[0].row1 - plan.segments[0].row0 == n + 1  # prompt: lane + the shorter sample
    q = torch.randn(len(rows), h, D, generator=gen).to(dtype)
    k = torch.randn(len(rows), g, D, generator=gen).to(dtype)
    v = torch.randn(len(rows), g, D, generator=gen).to(dtype)
    out = PagedAttention(kv, plan).attend(0, q, k, v)
    _check_rows(kv, rows, out, q, bs, 5 * TOL[dtype])
    # The next step: every row one token further; the cached plan pieces follow.
    rows2 = [(t, p + 1) for t, p in rows]
    plan2 = planner.plan([DecodeRow(t, p, key=i) for i, (t, p) in enumerate(rows2)], [])
    assert next(tg for tg in plan2.tails if tg.num_rows == n).length == 8
    out2 = PagedAttention(kv, plan2).attend(0, q, k, v)
    _check_rows(kv, rows2, out2, q, bs, 5 * TOL[dtype])


def test_no_context_is_copied_for_fragmented_segments():
    """A fragmented shared segment is read run by run in place (no gathered copy)."""
    bs = 4
    rows = [([9, 3, 7, 1, 20], 17), ([9, 3, 7, 1, 21], 18)]
    plan = build_step_plan(rows, [], bs, "bifurcated", torch.device("cpu"))
    assert [(e.first_slot, e.length) for e in plan.segments] == [(36, 4), (12, 4), (28, 4), (4, 4)]


def test_lane_groups_with_two_extents():
    """Samples that outgrew their first lane and took a second one, allocated together: both
    runs of every row line up (two strided reads for the group), merged exactly."""
    gen = torch.Generator().manual_seed(12)
    bs, h, g, D, n = 4, 4, 2, 8, 4
    kv = PagedKVCache(_config(h, g, D), 80, bs, torch.float32, torch.device("cpu"))
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    rows = [([0, 1] + [10 + 2 * i, 11 + 2 * i] + [40 + 3 * i, 41 + 3 * i], 8 + 8 + 5) for i in range(n)]
    rows.append(([0, 1, 70, 72], 8 + 6))  # a sibling with a scattered tail (two single-block runs)
    plan = StepPlanner(bs, "bifurcated", torch.device("cpu")).plan([DecodeRow(t, p, 2) for t, p in rows], [])
    group = next(tg for tg in plan.tails if tg.num_rows == n)
    assert [(r.stride, r.length) for r in group.runs] == [(8, 8), (12, 6)]
    q = torch.randn(len(rows), h, D, generator=gen)
    k = torch.randn(len(rows), g, D, generator=gen)
    v = torch.randn(len(rows), g, D, generator=gen)
    out = PagedAttention(kv, plan).attend(0, q, k, v)
    _check_rows(kv, rows, out, q, bs, 1e-5)


def test_plan_advanced_in_place_matches_the_reference_every_step():
    """The planner advances last step's decode plan instead of rebuilding it while the same rows
    each decode one more token: runs grow, a row of its own that jumps to a block elsewhere gets
    a new run, and a lane group whose rows leave their lanes is rebuilt. Every step's output
    equals the reference, and most steps were advanced, not rebuilt."""
    gen = torch.Generator().manual_seed(13)
    rng = random.Random(13)
    bs, h, g, D = 4, 4, 2, 8
    kv = PagedKVCache(_config(h, g, D), 400, bs, torch.float32, torch.device("cpu"))
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    free = list(range(399, 299, -1))  # scattered blocks for jumps
    prompt = [0, 1, 2]  # a shared 12-token prompt
    lanes = [prompt + [10 + 4 * i, 11 + 4 * i] for i in range(3)]  # a lane group of 3 (2 blocks each)
    own = [[100 + 20 * j + b for b in range(3)] for j in range(3)]  # rows of their own: 3 blocks each
    tables = lanes + own
    used = {b for t in tables for b in t}
    positions = [12 + 1] * 3 + [5, 9, 2]
    shareable = [3, 3, 3, 0, 0, 0]
    planner = StepPlanner(bs, "auto", torch.device("cpu"))
    steps = 24
    for step in range(steps):
        for table, pos in zip(tables, positions):
            if pos // bs >= len(table):  # the row crosses into a block it lacks
                nxt = table[-1] + 1
                block = nxt if rng.random() < 0.5 and nxt not in used and nxt < 300 else free.pop()
                used.add(block)
                table.append(block)
        rows = [DecodeRow(t, p, sb, key=i) for i, (t, p, sb) in enumerate(zip(tables, positions, shareable))]
        plan = planner.plan(rows, [])
        q = torch.randn(len(rows), h, D, generator=gen)
        k = torch.randn(len(rows), g, D, generator=gen)
        v = torch.randn(len(rows), g, D, generator=gen)
        out = PagedAttention(kv, plan).attend(0, q, k, v)
        _check_rows(kv, list(zip(tables, positions)), out, q, bs, 1e-5)
        positions = [p + 1 for p in positions]
    assert 1 < planner.rebuilds < steps // 2
    # A row leaves: the plan is rebuilt for the rest.
    before = planner.rebuilds
    rows = [DecodeRow(t, p, sb, key=i) for i, (t, p, sb) in enumerate(zip(tables, positions, shareable)) if i != 4]
    planner.plan(rows, [])
    assert planner.rebuilds == before + 1


def test_fresh_kv_pool_is_zeros():
    """Masked reads of ragged tails read slots no row has written: the pool must hold no NaN."""
    kv = PagedKVCache(_config(4, 2, 8), 16, 4, torch.bfloat16, torch.device("cpu"))
    assert all(torch.count_nonzero(t) == 0 for t in kv.k + kv.v)


@pytest.mark.parametrize("fallback", [False, True], ids=["flash", "matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ragged_tails_and_extends_are_masked_strided_reads(dtype, fallback, monkeypatch):
    """With the pool's size known, a lane group whose samples stand at different lengths is one
    masked strided read; the k rows of a multi-token extend are one unit (k·p query rows per KV
    head, causal by the mask); extends of equal k in strided lanes are one read for all of them.
    Every row equals the reference, whatever lies in the slots the masks hide. `matmul`: the
    fallback with materialized scores (what runs off CPU) takes the same masks."""
    if fallback:
        import forklm.attention.segments as segments

        monkeypatch.setattr(segments, "_CPU_FLASH", None)
    gen = torch.Generator().manual_seed(21)
    bs, h, g, D, K_blocks = 4, 6, 2, 16, 4
    kv = PagedKVCache(_config(h, g, D), 96, bs, dtype, torch.device("cpu"))
    # large values: a leak past a mask shows (not for bfloat16 scores of the matmul fallback,
    # which round too coarsely at that size whatever the mask)
    big = 4.0 if fallback and dtype == torch.bfloat16 else 1e3
    kv.k[0].copy_(big * torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(big * torch.randn(kv.v[0].shape, generator=gen))
    prompt = [0, 1, 2]  # 12 shared prompt tokens
    lane = lambda i: prompt + [10 + i * K_blocks + j for j in range(K_blocks)]  # noqa: E731
    ragged = [(lane(i), 12 + n - 1) for i, n in enumerate([3, 6, 4, 8])]  # decode rows, 4 lengths
    tables = [lane(i) for i in range(7)]  # an extend's rows list their sequence's table itself
    extend = [(tables[4], 12 + t) for t in range(2, 6)]  # one sample's 4-token extend
    pair = [(tables[5 + i], 12 + t) for i, base in enumerate([1, 3]) for t in range(base, base + 3)]  # two 3-token extends
    rows = [ragged[2], ragged[0], ragged[3], ragged[1]] + extend + pair
    keys = list(range(4)) + [None] * (len(extend) + len(pair))
    planner = StepPlanner(bs, "auto", torch.device("cpu"), num_slots=kv.num_slots)
    plan = planner.plan([DecodeRow(t, p, 3, key=k) for (t, p), k in zip(rows, keys)], [])
    shapes = sorted((tg.num_units, tg.rows_per_unit, tg.lengths is not None) for tg in plan.tails)
    assert shapes == [(1, 4, True), (2, 3, True), (4, 1, True)]
    q = torch.randn(len(rows), h, D, generator=gen).to(dtype)
    k = torch.randn(len(rows), g, D, generator=gen).to(dtype)
    v = torch.randn(len(rows), g, D, generator=gen).to(dtype)
    out = PagedAttention(kv, plan).attend(0, q, k, v)
    assert not out.isnan().any()
    _check_rows(kv, rows, out, q, bs, 5 * TOL[dtype])
    # Without the pool's size the planner reads them as before: one read per distinct length.
    plain = StepPlanner(bs, "auto", torch.device("cpu")).plan([DecodeRow(t, p, 3) for t, p in rows], [])
    assert all(tg.lengths is None and tg.rows_per_unit == 1 for tg in plain.tails) and len(plain.tails) > 3
    _check_rows(kv, rows, PagedAttention(kv, plain).attend(0, q, k, v), q, bs, 5 * TOL[dtype])


def test_ragged_group_stays_inside_the_pool_and_bounds_waste():
    """A lane whose longest read would run past the pool's last slot, or a sibling needing less
    than half of the longest read, gets reads of its own."""
    bs = 4
    lanes = [([0, 1] + [2 + 4 * i + j for j in range(4)], 8 + n - 1) for i, n in enumerate([10, 12])]
    far = [([0, 1, 22, 23], 8 + 7)]  # stride 12 would continue it, but its read of 12 passes slot 96
    plan = StepPlanner(bs, "auto", torch.device("cpu"), num_slots=96).plan(
        [DecodeRow(t, p, 2, key=i) for i, (t, p) in enumerate(lanes + far)], [])
    assert [tg.num_rows for tg in plan.tails] == [2, 1]
    short = [([0, 1, 14, 15, 16, 17], 8 + 1)]  # stride 12 continues the lanes, 2 tokens vs 12
    plan = StepPlanner(bs, "auto", torch.device("cpu"), num_slots=400).plan(
        [DecodeRow(t, p, 2, key=i) for i, (t, p) in enumerate(lanes + short)], [])
    assert [tg.num_rows for tg in plan.tails] == [2, 1]


def test_ragged_lane_group_is_advanced_in_place():
    """Samples of one request at different lengths keep decoding: the masked group's plan is
    advanced step by step (not rebuilt), and every step equals the reference."""
    gen = torch.Generator().manual_seed(22)
    bs, h, g, D = 4, 4, 2, 8
    kv = PagedKVCache(_config(h, g, D), 64, bs, torch.float32, torch.device("cpu"))
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    tables = [[0, 1] + [4 + 4 * i + j for j in range(4)] for i in range(3)]
    positions = [8 + 2, 8 + 5, 8 + 3]
    planner = StepPlanner(bs, "auto", torch.device("cpu"), num_slots=kv.num_slots)
    for step in range(6):
        rows = [(t, p + step) for t, p in zip(tables, positions)]
        plan = planner.plan([DecodeRow(t, p, 2, key=i) for i, (t, p) in enumerate(rows)], [])
        assert [(tg.num_rows, tg.lengths) for tg in plan.tails] == [(3, [3 + step, 6 + step, 4 + step])]
        q = torch.randn(3, h, D, generator=gen)
        k = torch.randn(3, g, D, generator=gen)
        v = torch.randn(3, g, D, generator=gen)
        _check_rows(kv, rows, PagedAttention(kv, plan).attend(0, q, k, v), q, bs, 1e-5)
    assert planner.rebuilds == 1


def test_extend_crossing_into_another_block_is_two_units():
    """An extend whose rows cross into a block not adjacent to the last one: the rows before and
    after the crossing have different runs, so they are two units (each one masked read)."""
    gen = torch.Generator().manual_seed(23)
    bs, h, g, D = 4, 4, 2, 8
    kv = PagedKVCache(_config(h, g, D), 40, bs, torch.float32, torch.device("cpu"))
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    table = [0, 1, 9, 20]  # tokens 8..11 in block 9, 12.. in block 20 (not adjacent)
    rows = [(table, t) for t in range(9, 14)]
    plan = StepPlanner(bs, "auto", torch.device("cpu"), num_slots=kv.num_slots).plan(
        [DecodeRow(t, p, 2) for t, p in rows], [])
    assert sorted(tg.rows_per_unit for tg in plan.tails) == [2, 3]
    q = torch.randn(len(rows), h, D, generator=gen)
    k = torch.randn(len(rows), g, D, generator=gen)
    v = torch.randn(len(rows), g, D, generator=gen)
    _check_rows(kv, rows, PagedAttention(kv, plan).attend(0, q, k, v), q, bs, 1e-5)
