"""The Triton shared-segment decode-attention kernel against a plain float64 reference.

On a machine without a GPU this runs through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 before anything imports triton), at small sizes; scripts/gpu_check.py runs the
same checks on a GPU. Outputs are poisoned with NaN before each run and every element is checked.
"""

import random
import zlib

import pytest
import torch

from bench.kernel_bench import random_sharing, reference_attention
from forklm.kernels.segment_attention import SegmentItem, available, plan_segments, segment_attention

pytestmark = pytest.mark.skipif(not available(), reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_items(rng: random.Random, b: int, bs: int, num_blocks: int) -> list[SegmentItem]:
    return random_sharing(rng, b, bs, num_blocks)


def reference(q, k_cache, v_cache, items, bs, scale):
    o, lse = reference_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), items, bs, scale)
    return o, lse


@pytest.mark.parametrize("h, g", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("b", [1, 3, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference(h, g, b, dtype):
    rng = random.Random(zlib.crc32(repr((h, g, b, str(dtype))).encode()))  # hash() is salted per process
    torch.manual_seed(rng.randrange(2**31))
    bs, D, num_blocks = 16, 64, 400
    items = random_items(rng, b, bs, num_blocks)
    k_cache = torch.randn(g, num_blocks * bs, D, device=DEVICE).to(dtype)
    v_cache = torch.randn(g, num_blocks * bs, D, device=DEVICE).to(dtype)
    q = torch.randn(b, h, D, device=DEVICE).to(dtype)
    # a small split length exercises flash-decoding splits even on short segments
    plan = plan_segments(items, b, h, g, bs, DEVICE, min_split=rng.choice([64, 128, 256]))
    out = torch.full((b, h, D), float("nan"), dtype=dtype, device=DEVICE)
    out_lse = torch.full((b, h), float("nan"), dtype=torch.float32, device=DEVICE)
    scale = D**-0.5
    segment_attention(q, k_cache, v_cache, plan, scale, out=out, out_lse=out_lse)
    assert torch.isfinite(out).all() and torch.isfinite(out_lse).all()
    ref_o, ref_lse = reference(q, k_cache, v_cache, items, bs, scale)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    err = ((out.double().cpu() - ref_o).norm() / ref_o.norm()).item()
    assert err < tol, err
    assert torch.allclose(out_lse.double().cpu(), ref_lse, atol=tol * 10, rtol=0)


@pytest.mark.parametrize("D", [128])
def test_head_dim_128_and_long_split_segment(D):
    rng = random.Random(5)
    bs, h, g, b, num_blocks = 16, 8, 2, 5, 80
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = SegmentItem(list(range(b)), free[:60], 60 * bs - 7)  # split into several programs
    tails = [SegmentItem([r], [free[60 + r]], 1 + r) for r in range(b)]
    items = [shared] + tails
    k_cache = torch.randn(g, num_blocks * bs, D, device=DEVICE)
    v_cache = torch.randn(g, num_blocks * bs, D, device=DEVICE)
    q = torch.randn(b, h, D, device=DEVICE)
    plan = plan_segments(items, b, h, g, bs, DEVICE, min_split=128)
    assert plan.num_programs > len(items)  # the shared segment was split along its keys
    o, lse = segment_attention(q, k_cache, v_cache, plan)
    ref_o, ref_lse = reference(q, k_cache, v_cache, items, bs, D**-0.5)
    assert ((o.double().cpu() - ref_o).norm() / ref_o.norm()).item() < 1e-5
    assert torch.allclose(lse.double().cpu(), ref_lse, atol=1e-4, rtol=0)


def test_plan_rejects_inconsistent_items():
    with pytest.raises(ValueError, match="multiple"):
        plan_segments([SegmentItem([0], [0], 3)], 1, 6, 4, 16, "cpu")
    with pytest.raises(ValueError, match="blocks"):
        plan_segments([SegmentItem([0], [0], 17)], 1, 4, 2, 16, "cpu")
    with pytest.raises(ValueError, match="at least one"):
        plan_segments([SegmentItem([], [0], 3)], 1, 4, 2, 16, "cpu")
    plan = plan_segments([SegmentItem([0], [0], 3)], 1, 4, 2, 16, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        segment_attention(torch.randn(1, 4, 24), torch.randn(2, 16, 24), torch.randn(2, 16, 24), plan)


def tiny_f32_model(seed: int = 7):
    """2 layers, 4 query heads over 2 KV heads, head dim 16 (the kernel's minimum), float32."""
    from conftest import tiny_llama

    return tiny_llama(29, 64, 4, 2, 16, 96, 2, torch.float32, seed=seed, max_positions=1024)


def test_engine_with_triton_decode_kernel_equals_torch_path():
    """The engine's decode attention through the kernel (shared prompts, samples, own tails)
    gives the same samples as the torch path, on a model small enough for the interpreter."""
    from forklm.engine.engine import Engine, EngineConfig
    from forklm.sampling.params import SamplingParams

    model = tiny_f32_model()
    rng = random.Random(3)
    system = [rng.randrange(29) for _ in range(37)]
    prompts = [system + [rng.randrange(29) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    outs = {}
    for kernel in ("torch", "triton"):
        engine = Engine(model, lambda ids: " ".join(map(str, ids)), (), EngineConfig(num_blocks=64,
                        decode_kernel=kernel, block_size=8))
        states = [engine.add_request(p, SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=i))
                  for i, p in enumerate(prompts)]
        engine.run()
        engine.check_integrity()
        outs[kernel] = [st.output for st in states]
    for a, b in zip(outs["torch"], outs["triton"]):
        for sa, sb in zip(a.samples, b.samples):
            assert sa.token_ids == sb.token_ids
            assert sa.logprobs == pytest.approx(sb.logprobs, abs=1e-4)


def test_decode_kernel_option_is_checked():
    from forklm.engine.engine import EngineConfig
    from forklm.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="decode_kernel"):
        EngineConfig(decode_kernel="cuda-magic")
