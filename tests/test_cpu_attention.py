"""The C++ decode attention (kernels/cpu_attention.py) against a slow float64 reference, its
rotary + K/V write bit for bit against the model's PyTorch operators, and the engine on it against
the PyTorch attention path."""

from __future__ import annotations

import math
import random

import pytest
import torch

from forklm.kernels import block_gemm as bg
from forklm.kernels import cpu_attention as ca
from forklm.kernels.segment_attention import SegmentItem
from forklm.models.llama import apply_rope

pytestmark = pytest.mark.skipif(not bg.cpu_supports(), reason="the CPU attention kernel needs x86-64 with AVX2, FMA")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_items(rng: random.Random, num_rows: int, num_blocks: int, bs: int, shared_blocks: int,
                 tail_max: int, adjacent: bool = False) -> list[SegmentItem]:
    """A shared prompt of `shared_blocks` full blocks read by every row (if any), then each row's own
    tail of 1..tail_max tokens; blocks shuffled (or in order: runs of adjacent blocks)."""
    blocks = list(range(num_blocks))
    if not adjacent:
        rng.shuffle(blocks)
    items, used = [], shared_blocks
    if shared_blocks:
        items.append(SegmentItem(list(range(num_rows)), blocks[:shared_blocks], shared_blocks * bs))
    for r in range(num_rows):
        n = rng.randint(1, tail_max)
        nb = -(-n // bs)
        items.append(SegmentItem([r], blocks[used : used + nb], n))
        used += nb
    return items


@pytest.mark.parametrize(
    "num_rows,g,p,D,bs,shared,tail,chunk,adjacent",
    [
        (1, 3, 3, 64, 16, 0, 300, 512, False),  # one sample, everything its own
        (1, 3, 3, 64, 16, 16, 40, 512, True),  # adjacent blocks: pieces of 64 keys
        (8, 3, 3, 64, 16, 16, 40, 512, False),  # samples sharing a prompt
        (64, 3, 3, 64, 16, 8, 20, 32, False),  # many samples, keys split into chunks
        (5, 2, 4, 16, 8, 5, 30, 16, False),  # head dim 16, 4 query heads per KV head
        (3, 1, 7, 128, 4, 9, 13, 8, True),  # MQA, head dim 128, tiny blocks
        (6, 4, 1, 32, 16, 3, 70, 48, False),  # MHA (one query head per KV head)
        (11, 3, 3, 64, 16, 8, 20, 64, True),  # 33 query vectors a KV head: row tiles 6 x 5 + 3
        (29, 2, 1, 32, 16, 4, 10, 64, False),  # 29: row tiles 6 x 4 + 4 + 1
    ],
)
def test_kernel_matches_reference(num_rows, g, p, D, bs, shared, tail, chunk, adjacent):
    rng = random.Random(num_rows * 1000 + D)
    torch.manual_seed(num_rows + D)
    num_blocks = shared + num_rows * (-(-tail // bs)) + 3
    k_cache, v_cache = torch.randn(g, num_blocks * bs, D), torch.randn(g, num_blocks * bs, D)
    items = random_items(rng, num_rows, num_blocks, bs, shared, tail, adjacent)
    q = torch.randn(num_rows, g * p, D) * 2
    plan = ca.plan_items(items, num_rows, bs)
    out = ca.paged_attention(q, k_cache, v_cache, plan, g * p, chunk_tokens=chunk)
    ref = ca.paged_attention_reference(q, k_cache, v_cache, items, bs)
    assert out.shape == (num_rows, g * p * D)
    assert rel_err(out, ref) < 2e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_rows,shared,tail", [(1, 0, 300), (8, 16, 40), (64, 4, 20)])
def test_half_caches_match_reference(num_rows, shared, tail, dtype):
    """A float16 or bfloat16 cache read in float32 arithmetic: the reference reads the same values
    (bfloat16 queries, a bfloat16 model's, widened exactly by the caller)."""
    rng = random.Random(num_rows)
    g, p, D, bs = 3, 3, 64, 16
    num_blocks = shared + num_rows * (-(-tail // bs)) + 3
    k_cache = torch.randn(g, num_blocks * bs, D).to(dtype)
    v_cache = torch.randn(g, num_blocks * bs, D).to(dtype)
    items = random_items(rng, num_rows, num_blocks, bs, shared, tail)
    q = torch.randn(num_rows, g * p, D) * 2
    out = ca.paged_attention(q, k_cache, v_cache, ca.plan_items(items, num_rows, bs), g * p, chunk_tokens=32)
    ref = ca.paged_attention_reference(q, k_cache, v_cache, items, bs)
    assert rel_err(out, ref) < 2e-6


def test_every_row_is_exact_on_its_own():
    """Row by row (not only in norm): sharp and flat score distributions, a row with one key."""
    rng = random.Random(5)
    g, p, D, bs = 3, 3, 64, 16
    k_cache, v_cache = torch.randn(g, 40 * bs, D), torch.randn(g, 40 * bs, D)
    items = random_items(rng, 4, 40, bs, 6, 33) + [SegmentItem([4], [39], 1)]
    q = torch.randn(5, g * p, D)
    q[0] *= 20  # nearly one-hot attention
    q[1] *= 1e-3  # nearly uniform
    out = ca.paged_attention(q, k_cache, v_cache, ca.plan_items(items, 5, bs), g * p)
    ref = ca.paged_attention_reference(q, k_cache, v_cache, items, bs)
    for r in range(5):
        assert rel_err(out[r], ref[r]) < 2e-6, r
    torch.testing.assert_close(out[4].view(g * p, D), v_cache[:, 39 * bs].repeat_interleave(p, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_rows_output_does_not_depend_on_the_rows_beside_it_or_its_blocks_places(dtype):
    """Batch invariance, bit for bit: one row's 700 keys (two chunks of 512 positions) read as its own
    item alone; behind a prompt shared with 30 other rows (93 query vectors a KV head: the many-row
    tiles); behind nested shared segments whose second spans the chunk boundary; with its blocks
    scattered over the pool instead of adjacent; and with rows of other requests around it: the same
    output every time, and exact against the float64 reference."""
    g, p, D, bs, T = 3, 3, 64, 16, 700
    nb = -(-T // bs)
    pool = 4 * nb + 200
    torch.manual_seed(11)
    keys, values = (torch.randn(g, nb * bs, D) * 1.5).to(dtype), torch.randn(g, nb * bs, D).to(dtype)
    q = torch.randn(1, g * p, D) * 2
    others_q = torch.randn(60, g * p, D) * 2

    def run(block_ids: list[int], shapes: list[tuple[int, int]], extra: int):
        """The row's blocks at `block_ids`; `shapes` [(blocks, rows)] its shared segments in order, read
        by it and `rows - 1` others; `extra` rows of another request beside them, on blocks of their own."""
        k_cache, v_cache = torch.randn(g, pool * bs, D).to(dtype), torch.randn(g, pool * bs, D).to(dtype)
        ids = torch.tensor(block_ids)
        slot = (ids[:, None] * bs + torch.arange(bs)).reshape(-1)
        k_cache[:, slot], v_cache[:, slot] = keys, values
        items, start, next_row = [], 0, 1
        for blocks, rows in shapes:
            items.append(SegmentItem([0, *range(next_row, next_row + rows - 1)], block_ids[start : start + blocks],
                                     blocks * bs))
            start += blocks
        rows_here = 1 + max((r for it in items for r in it.rows), default=0)
        for r in range(1, rows_here):  # the other rows' tails: one token each, in a free block
            items.append(SegmentItem([r], [pool - 1 - r], 1 + r % bs))
        items.append(SegmentItem([0], block_ids[start:], T - start * bs))
        for e in range(extra):
            items.append(SegmentItem([rows_here + e], [pool - 100 - e], 1 + (5 + e) % bs))
        num_rows = rows_here + extra
        qq = torch.cat([q, others_q[: num_rows - 1]])
        out = ca.paged_attention(qq, k_cache, v_cache, ca.plan_items(items, num_rows, bs), g * p)
        mine = [SegmentItem([0], it.blocks, it.num_tokens) for it in items if 0 in it.rows]
        ref = ca.paged_attention_reference(qq[:1], k_cache, v_cache, mine, bs)
        assert rel_err(out[:1], ref) < 2e-6
        return out[0]

    adjacent = list(range(nb))
    scattered = random.Random(3).sample(range(nb, 4 * nb), nb)
    alone = run(adjacent, [], 0)
    cases = {
        "scattered": run(scattered, [], 0),
        "shared by 31 rows": run(adjacent, [(20, 31)], 0),
        "nested, across the chunk boundary": run(scattered, [(10, 41), (25, 10)], 0),
        "two rows, beside another request": run(adjacent, [(43, 2)], 7),
        "shared by 8 rows, beside another request": run(scattered, [(30, 8)], 20),
    }
    for name, got in cases.items():
        assert torch.equal(got, alone), name


@pytest.mark.parametrize("fused", [False, True])
def test_rows_run_in_groups_past_the_state_budget_with_the_same_bits(fused):
    """Past the chunk states' budget a call runs its rows in groups, each reading its items' keys
    again: the output is the same bits at any budget (one row a group, a few, all), with the rotary
    and cache write of a prefill-like step (rows in block b read blocks [0, b) then their own) too."""
    rng = random.Random(5)
    torch.manual_seed(5)
    g, p, D, bs, chunk = 3, 3, 64, 16, 64
    num_rows, shared = 40, 12
    num_blocks = shared + num_rows * 4 + 8
    k_cache, v_cache = torch.randn(g, num_blocks * bs, D), torch.randn(g, num_blocks * bs, D)
    items = random_items(rng, num_rows, num_blocks, bs, shared, 60)
    items.insert(1, SegmentItem(list(range(0, num_rows, 3)), [num_blocks - 1], 9))  # a second shared level
    plan = ca.plan_items(items, num_rows, bs)
    h = g * p
    if fused:
        T = num_rows + 5
        qkv = torch.randn(T, (h + 2 * g) * D)
        pos = torch.randint(0, 4000, (T,)).float()[:, None]
        freqs = 1.0 / 10000 ** (torch.arange(D // 2).float() / (D // 2))
        ang = torch.cat([pos * freqs, pos * freqs], dim=1)
        sin = ang.sin()
        sin[:, : D // 2] *= -1
        slots = torch.tensor(rng.sample(range(num_blocks * bs), T))
        rope = (ang.cos(), sin, slots)
    default = ca.state_budget_bytes()
    q = torch.randn(num_rows, h, D) * 2
    outs, caches = [], []
    try:
        for budget in (default, 1, 3 * h * (D + 9) * 4 * 2, 40_000):  # all rows; one; ~2; a few a group
            ca.set_state_budget_bytes(budget)
            kc, vc = k_cache.clone(), v_cache.clone()
            if fused:
                outs.append(ca.paged_attention(qkv, kc, vc, plan, h, rope=rope, chunk_tokens=chunk))
            else:
                outs.append(ca.paged_attention(q, kc, vc, plan, h, chunk_tokens=chunk))
            caches.append((kc, vc))
    finally:
        ca.set_state_budget_bytes(default)
    assert ca.state_budget_bytes() == default
    for o, (kc, vc) in zip(outs[1:], caches[1:]):
        assert torch.equal(o, outs[0])
        assert torch.equal(kc, caches[0][0]) and torch.equal(vc, caches[0][1])
    if not fused:
        ref = ca.paged_attention_reference(q, k_cache, v_cache, items, bs)
        assert rel_err(outs[0], ref) < 2e-6


def test_rope_and_cache_write_are_the_models_bit_for_bit():
    """With rotary tables the call rotates q and k exactly as `apply_rope` does, writes k and v to
    their slots (nothing else in the cache changes), then attends over the written cache."""
    torch.manual_seed(2)
    rng = random.Random(2)
    g, h, D, bs, nb, T = 3, 9, 64, 16, 50, 6
    k_cache, v_cache = torch.randn(g, nb * bs, D), torch.randn(g, nb * bs, D)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(T, (h + 2 * g) * D)
    pos = torch.randint(0, 4000, (T,))
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([pos.float()[:, None] * inv] * 2, -1)
    cos, sin = emb.cos()[:, None], emb.sin()
    sin_signed = torch.cat([-sin[:, : D // 2], sin[:, D // 2 :]], -1)[:, None]
    slots = torch.tensor(rng.sample(range(nb * bs), T))
    items = [SegmentItem([r], [int(s) // bs], int(s) % bs + 1) for r, s in enumerate(slots)]
    out = ca.paged_attention(qkv, k_cache, v_cache, ca.plan_items(items, T, bs), h, rope=(cos, sin_signed, slots))
    qk = apply_rope(qkv[:, : (h + g) * D].view(T, h + g, D), cos, sin_signed)
    k_ref.index_copy_(1, slots, qk[:, h:].transpose(0, 1))
    v_ref.index_copy_(1, slots, qkv[:, (h + g) * D :].view(T, g, D).transpose(0, 1))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    ref = ca.paged_attention_reference(qk[:, :h].contiguous(), k_ref, v_ref, items, bs)
    assert rel_err(out, ref) < 2e-6
    # a float16 cache gets the same values rounded to nearest even, as torch's .to(float16)
    k16, v16 = k_cache.half(), v_cache.half()
    out16 = ca.paged_attention(qkv, k16, v16, ca.plan_items(items, T, bs), h, rope=(cos, sin_signed, slots))
    assert torch.equal(k16[:, slots], qk[:, h:].transpose(0, 1).half())
    assert torch.equal(v16[:, slots], qkv[:, (h + g) * D :].view(T, g, D).transpose(0, 1).half())
    assert rel_err(out16, ca.paged_attention_reference(qk[:, :h].contiguous(), k16, v16, items, bs)) < 2e-6
    # and a bfloat16 cache as torch's .to(bfloat16) rounds (to nearest even; ties, NaN, infinities and overflow)
    qkv[0, (h + g) * D : (h + g) * D + 6] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("nan"), float("inf"),
                                                          -float("inf"), 3e38])
    kb, vb = k_ref.bfloat16(), v_ref.bfloat16()
    ca.paged_attention(qkv, kb, vb, ca.plan_items(items, T, bs), h, rope=(cos, sin_signed, slots))
    assert torch.equal(kb[:, slots], qk[:, h:].transpose(0, 1).bfloat16())
    want = qkv[:, (h + g) * D :].view(T, g, D).transpose(0, 1).bfloat16()
    torch.testing.assert_close(vb[:, slots], want, rtol=0, atol=0, equal_nan=True)  # exactly (a NaN as a NaN)


def test_non_finite_keys_stay_in_their_rows():
    """A NaN key poisons the rows that read it, like a dense softmax; the other rows stay exact."""
    g, p, D, bs = 2, 2, 32, 8
    k_cache, v_cache = torch.randn(g, 10 * bs, D), torch.randn(g, 10 * bs, D)
    k_cache[0, 3 * bs + 2, 5] = float("nan")
    items = [SegmentItem([0], [3], 5), SegmentItem([1], [4, 5], 12)]
    q = torch.randn(2, g * p, D)
    out = ca.paged_attention(q, k_cache, v_cache, ca.plan_items(items, 2, bs), g * p).view(2, g * p, D)
    assert torch.isnan(out[0, :p]).all()  # KV head 0's query heads
    assert torch.isfinite(out[0, p:]).all() and torch.isfinite(out[1]).all()


def test_bad_plans_are_refused_with_a_message():
    g, h, D, bs = 2, 4, 16, 8
    k_cache, v_cache = torch.randn(g, 4 * bs, D), torch.randn(g, 4 * bs, D)
    q = torch.randn(1, h, D)

    def run(items, rows=1, **kw):
        return ca.paged_attention(q[:rows], k_cache, v_cache, ca.plan_items(items, rows, bs), h, **kw)

    with pytest.raises(RuntimeError, match="block id out of range"):
        run([SegmentItem([0], [4], 3)])
    with pytest.raises(RuntimeError, match="at most as many tokens"):
        run([SegmentItem([0], [1], 9)])
    with pytest.raises(RuntimeError, match="row out of range"):
        run([SegmentItem([1], [1], 3)])
    with pytest.raises(RuntimeError, match="reads no item"):
        ca.paged_attention(torch.randn(2, h, D), k_cache, v_cache, ca.plan_items([SegmentItem([0], [1], 3)], 2, bs), h)
    with pytest.raises(RuntimeError, match="no item"):  # rows and an empty plan: never uninitialized rows
        ca.paged_attention(torch.randn(2, h, D), k_cache, v_cache, ca.plan_items([], 2, bs), h)
    assert ca.paged_attention(q[:0], k_cache, v_cache, ca.plan_items([], 0, bs), h).shape == (0, h * D)
    with pytest.raises(RuntimeError, match="float32"):
        ca.paged_attention(q.double(), k_cache, v_cache, ca.plan_items([SegmentItem([0], [1], 3)], 1, bs), h)
    with pytest.raises(RuntimeError, match="multiple"):  # 3 query heads over 2 KV heads
        ca.paged_attention(torch.randn(1, 3, D), k_cache, v_cache, ca.plan_items([SegmentItem([0], [1], 3)], 1, bs), 3)
    qkv = torch.randn(1, (h + 2 * g) * D)
    cs = torch.randn(1, 1, D)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ca.paged_attention(qkv, k_cache, v_cache, ca.plan_items([SegmentItem([0], [1], 3)], 1, bs), h,
                           rope=(cs, cs, torch.tensor([4 * bs])))


def tiny_f32_model(seed: int = 7):
    from conftest import tiny_llama

    return tiny_llama(29, 64, 4, 2, 16, 96, 2, torch.float32, seed=seed, max_positions=1024)


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_engine_on_cpu_kernel_equals_torch_path(speculative):
    """Shared prompts, samples, chunked prefill beside decode rows (the kernel without rotary then),
    multi-token extends (speculation): the same samples as PyTorch's attention path."""
    from forklm.engine.engine import Engine, EngineConfig
    from forklm.sampling.params import SamplingParams

    model = tiny_f32_model()
    rng = random.Random(3)
    system = [rng.randrange(29) for _ in range(37)]
    prompts = [system + [rng.randrange(29) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    prompts.append([rng.randrange(29) for _ in range(90)])  # a long prompt: prefilled in chunks beside decodes
    outs = {}
    for kernel in ("torch", "cpu"):
        engine = Engine(model, lambda ids: " ".join(map(str, ids)), (), EngineConfig(
            num_blocks=96, decode_kernel=kernel, block_size=8, max_batch_tokens=24, speculative=speculative))
        assert engine.decode_kernel == kernel
        states = [engine.add_request(p, SamplingParams(n=4, max_tokens=14, temperature=1.0, seed=i))
                  for i, p in enumerate(prompts)]
        engine.run()
        engine.check_integrity()
        outs[kernel] = [st.output for st in states]
    for a, b in zip(outs["torch"], outs["cpu"]):
        for sa, sb in zip(a.samples, b.samples):
            assert sa.token_ids == sb.token_ids
            assert sa.logprobs == pytest.approx(sb.logprobs, abs=1e-4)


def test_auto_picks_the_cpu_kernel_for_float32_and_bfloat16():
    """float32 and bfloat16 models decode on the C++ kernel (a bfloat16 one over its bfloat16 cache);
    a head dim that is not a multiple of 16 keeps PyTorch's path, and asking for the kernel then is refused."""
    from forklm.engine.engine import Engine, EngineConfig
    from forklm.errors import InvalidArgumentError

    model = tiny_f32_model()
    assert Engine(model, None, (), EngineConfig(num_blocks=8)).decode_kernel == "cpu"
    from conftest import tiny_llama

    bf16 = tiny_llama(29, 64, 4, 2, 16, 96, 1, torch.bfloat16, seed=1)
    engine = Engine(bf16, None, (), EngineConfig(num_blocks=8))
    assert engine.decode_kernel == "cpu" and engine.kv.dtype == torch.bfloat16
    odd = tiny_llama(29, 48, 4, 2, 12, 96, 1, torch.bfloat16, seed=1)  # head dim 12
    assert Engine(odd, None, (), EngineConfig(num_blocks=8)).decode_kernel == "torch"
    with pytest.raises(InvalidArgumentError, match="decode_kernel='cpu'"):
        Engine(odd, None, (), EngineConfig(num_blocks=8, decode_kernel="cpu"))


def test_bfloat16_engine_on_cpu_kernel_follows_torch_path():
    """A bfloat16 model: shared prompts, samples and chunked prefill beside decode rows on the C++ kernel
    (float32 arithmetic over the bfloat16 cache, prefill chunks included) against PyTorch's bfloat16
    attention (bfloat16 arithmetic): greedy samples' tokens agree until a near-tie and their
    log-probabilities within the two paths' bfloat16 rounding."""
    from conftest import tiny_llama

    from forklm.engine.engine import Engine, EngineConfig
    from forklm.sampling.params import SamplingParams

    model = tiny_llama(29, 64, 4, 2, 16, 96, 2, torch.bfloat16, seed=4, max_positions=1024)
    rng = random.Random(5)
    system = [rng.randrange(29) for _ in range(37)]
    prompts = [system + [rng.randrange(29) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    outs = {}
    for kernel in ("torch", "cpu"):
        engine = Engine(model, lambda ids: " ".join(map(str, ids)), (), EngineConfig(
            num_blocks=96, decode_kernel=kernel, block_size=8, max_batch_tokens=24))
        states = [engine.add_request(p, SamplingParams(n=2, max_tokens=12, temperature=0.0, seed=i))
                  for i, p in enumerate(prompts)]
        engine.run()
        engine.check_integrity()
        outs[kernel] = [s for st in states for s in st.output.samples]
    agree = 0
    for a, b in zip(outs["torch"], outs["cpu"]):
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if ta != tb:
                break
            assert la == pytest.approx(lb, abs=0.1)
            agree += 1
    assert agree >= 0.75 * sum(len(s.token_ids) for s in outs["torch"])


def test_kv_dtype_rule_and_checks(smollm2_gguf):
    """kv_dtype="auto": float16 for quantized weights on the C++ kernel, the model's dtype otherwise;
    float16 elsewhere is refused by name."""
    from forklm.engine.engine import Engine, EngineConfig
    from forklm.errors import InvalidArgumentError

    tiny = tiny_f32_model()
    assert Engine(tiny, None, (), EngineConfig(num_blocks=8)).kv.dtype == torch.float32
    assert Engine(tiny, None, (), EngineConfig(num_blocks=8, kv_dtype="float16")).kv.dtype == torch.float16
    with pytest.raises(InvalidArgumentError, match="kv_dtype='float16'"):
        Engine(tiny, None, (), EngineConfig(num_blocks=8, kv_dtype="float16", decode_kernel="torch"))
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        EngineConfig(kv_dtype="int8")
    from forklm import LLM

    llm = LLM("smollm2-135m", dtype="float32")  # GGUF blocks kept: quantized
    assert llm.model.quantize == "gguf"
    assert Engine(llm.model, None, (), EngineConfig(num_blocks=8)).kv.dtype == torch.float16
    assert Engine(llm.model, None, (), EngineConfig(num_blocks=8, kv_dtype="model")).kv.dtype == torch.float32


def test_float16_cache_decodes_like_float32(smollm2_f32):
    """The default model (dense float32) with a float16 cache: greedy tokens equal to the float32
    cache's, log-probabilities within float16 rounding of K and V; prefill chunks (the PyTorch path
    over the float16 cache) beside decode rows included."""
    prompt = "def fibonacci(n):\n    " * 6
    got = {}
    for kv_dtype in ("model", "float16"):
        outs = smollm2_f32.generate([{"prompt": prompt, "n": 2, "max_tokens": 24, "temperature": 0.0},
                                     {"prompt": "Explain what a hash map is.", "n": 1, "max_tokens": 24, "temperature": 0.0}],
                                    kv_dtype=kv_dtype, max_batch_tokens=32)
        got[kv_dtype] = outs
    for a, b in zip(got["model"], got["float16"]):
        for sa, sb in zip(a.samples, b.samples):
            assert sa.token_ids == sb.token_ids
            assert sa.logprobs == pytest.approx(sb.logprobs, abs=3e-2)


def test_default_model_decodes_the_same_on_both_paths(smollm2_f32):
    """The default model in float32 (dense weights: on the block kernel, whose int8 activations turn
    float32 rounding differences into whole quantization steps, the paths differ by more): samples
    equal on the C++ attention and on PyTorch's, their log-probabilities within float32 rounding."""
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    got = {}
    for kernel in ("cpu", "torch"):
        outs = smollm2_f32.generate([{"prompt": prompt, "n": 3, "max_tokens": 24, "temperature": 0.8, "seed": 11}],
                                    decode_kernel=kernel)
        got[kernel] = outs[0]
    for a, b in zip(got["cpu"].samples, got["torch"].samples):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)
    assert math.isfinite(sum(got["cpu"].samples[0].logprobs))


@pytest.mark.skipif(not bg.uses_vnni(), reason="this CPU has no AVX512-VNNI: the attention runs its AVX2 build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [16, 64, 128])
def test_avx512_build_equals_the_avx2_build_bit_for_bit(dtype, D):
    """On CPUs with AVX512-VNNI the kernel loads its AVX-512 build, whose many-query-row tiles (a shared
    prompt read by many samples) run the AVX2 build's chains 16 lanes a vector: every output equals the
    AVX2 build's bit for bit, at pieces of 16-64 keys (tiny blocks, runs of adjacent blocks, chunks) and
    every row-tile remainder, and both stay exact against the float64 reference."""
    avx2 = bg.load_cpu_extension("forklm_paged_attention", ca._SOURCE)
    wide = ca._extension()
    assert avx2 is not wide and "vnni" in wide.__name__ and ca.loaded_build() == "AVX512-VNNI"
    g, bs = 2, 16
    for num_rows, p, shared, tail, chunk, adjacent in ((9, 6, 37, 30, 512, True), (31, 3, 9, 20, 48, False),
                                                      (13, 2, 20, 70, 64, True), (5, 7, 4, 40, 512, False)):
        rng = random.Random(num_rows * 31 + D)
        num_blocks = shared + num_rows * (-(-tail // bs)) + 3
        k_cache = (torch.randn(g, num_blocks * bs, D) * 1.5).to(dtype)
        v_cache = torch.randn(g, num_blocks * bs, D).to(dtype)
        items = random_items(rng, num_rows, num_blocks, bs, shared, tail, adjacent)
        q = torch.randn(num_rows, g * p, D) * 2
        plan = ca.plan_items(items, num_rows, bs)
        args = (None, None, k_cache, v_cache, None, g * p, plan.num_rows, plan.rows_start, plan.rows, plan.blocks_start,
                plan.blocks, plan.tokens, bs, 1.0 / math.sqrt(D), chunk)
        a, b = avx2.paged_attention(q, *args), wide.paged_attention(q, *args)
        assert torch.equal(a, b), (num_rows, p)
        ref = ca.paged_attention_reference(q, k_cache, v_cache, items, bs)
        assert rel_err(b, ref) < 2e-6
