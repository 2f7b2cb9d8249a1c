"""The model's fused elementwise operators against transformers' formulas, operator by operator."""

import pytest
import torch

from forklm.models.llama import apply_rope, rms_norm, rms_norm_reference, rotate_half


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_matches_transformers_formula(dtype, rows):
    g = torch.Generator().manual_seed(1000 + rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = (torch.rand(576, generator=g) + 0.5).to(dtype)
    got, want = rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5)
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    # float32: the same math with a different reduction order; half types: one rounding of the
    # normalized value apart at most, as the reference rounds it
    tol = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}[dtype]
    assert _rel(got, want) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_is_rotate_half_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(7)
    T, heads, D = 5, 12, 64
    x = torch.randn(T, heads, D, generator=g).to(dtype)
    angles = torch.rand(T, 1, D // 2, generator=g) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    sin_signed = torch.cat((-sin[..., : D // 2], sin[..., D // 2 :]), dim=-1)
    want = x * cos + rotate_half(x) * sin
    got = apply_rope(x, cos, sin_signed)
    assert torch.equal(got, want)
    # on a strided view (q and k heads sliced out of the fused qkv product)
    qkv = torch.randn(T, (heads + 4) * D, generator=g).to(dtype)
    view = qkv[:, : heads * D].view(T, heads, D)
    assert torch.equal(apply_rope(view, cos, sin_signed), view * cos + rotate_half(view) * sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_tables_grow_and_equal_per_step_computation(dtype):
    from conftest import tiny_llama

    model = tiny_llama(64, 32, 4, 2, 8, 48, 1, dtype, seed=3)
    for positions in ([0, 1, 2], [4095], [5000, 17, 9000], [3]):  # the table grows past 4096 twice
        pos = torch.tensor(positions)
        cos, sin = model._rope(pos)
        want_cos, want_sin = model._rope_tables(pos)  # computed for these positions alone
        assert cos.shape == (len(positions), 1, 8) and cos.dtype == dtype
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert model._rope_len >= 9001


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_partials_matches_the_design_formula(dtype):
    from forklm.attention.segments import merge_partials, merge_partials_reference

    g = torch.Generator().manual_seed(11)
    o_a, o_b = torch.randn(2, 3, 5, 16, generator=g).to(dtype), torch.randn(2, 3, 5, 16, generator=g).to(dtype)
    lse_a, lse_b = torch.randn(2, 3, 5, generator=g) * 8, torch.randn(2, 3, 5, generator=g) * 8
    o, lse = merge_partials(o_a, lse_a, o_b, lse_b)
    o_ref, lse_ref = merge_partials_reference(o_a, lse_a, o_b, lse_b)
    assert o.dtype == dtype and torch.equal(lse, lse_ref)
    assert ((o.float() - o_ref.float()).norm() / o_ref.float().norm()).item() < (1e-6 if dtype == torch.float32 else 4e-3)
    # a partial with no mass (-inf) leaves the other one as it is
    empty = torch.full_like(lse_a, float("-inf"))
    o, lse = merge_partials(o_a.float(), lse_a, o_b.float() * 1e3, empty)
    assert torch.equal(o, o_a.float()) and torch.equal(lse, lse_a)
    o, lse = merge_partials(o_a.float() * 1e3, empty, o_b.float(), lse_b)
    assert torch.equal(o, o_b.float()) and torch.equal(lse, lse_b)
