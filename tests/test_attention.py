"""Decode attention: bifurcated == standard == the plain reference, over random shapes."""

import pytest
import torch

from forklm.reference.forked_attention import DecodeAttention, PrefillAttention
from forklm.attention.reference import reference_decode_attention
from forklm.attention.segments import attend_segment, attend_segment_matmul, merge_partials
from forklm.reference.forked_kv import ForkedKVCache

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_cache(g, D, m_c, own_len, b, dtype, gen):
    cache = ForkedKVCache(1, g, D, m_c, own_len + 1, b, dtype, "cpu")
    cache.ctx_k[0].copy_(torch.randn(1, g, m_c, D, generator=gen))
    cache.ctx_v[0].copy_(torch.randn(1, g, m_c, D, generator=gen))
    cache.fork()
    cache.own_k[0].copy_(torch.randn(b, g, own_len + 1, D, generator=gen))
    cache.own_v[0].copy_(torch.randn(b, g, own_len + 1, D, generator=gen))
    cache.own_len = own_len
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,g", [(4, 4), (8, 2), (9, 3), (6, 1)])  # MHA, GQA, GQA, MQA
@pytest.mark.parametrize("b", [1, 2, 7, 64])
def test_decode_paths_match_reference(dtype, h, g, b):
    gen = torch.Generator().manual_seed(1000 * h + 10 * g + b)
    D = 64 if b != 64 else 32
    m_c = int(torch.randint(1, 300, (1,), generator=gen))
    own_len = int(torch.randint(0, 40, (1,), generator=gen))
    cache = make_cache(g, D, m_c, own_len, b, dtype, gen)
    q = torch.randn(b, h, D, generator=gen).to(dtype)
    k = torch.randn(b, g, D, generator=gen).to(dtype)
    v = torch.randn(b, g, D, generator=gen).to(dtype)
    outs = {}
    for path in ("standard", "bifurcated"):
        outs[path] = DecodeAttention(cache, path).attend(0, q, k, v)
        assert outs[path].shape == (b, h, D) and outs[path].dtype == dtype
    # The new key/value went into the own slot at own_len.
    assert torch.equal(cache.own_k[0][:, :, own_len], k)
    ref = reference_decode_attention(
        q, cache.ctx_k[0][0], cache.ctx_v[0][0], cache.own_k[0][:, :, : own_len + 1], cache.own_v[0][:, :, : own_len + 1]
    )
    tol = TOL[dtype]
    assert rel_err(outs["bifurcated"], ref) < tol
    assert rel_err(outs["standard"], ref) < tol
    assert rel_err(outs["bifurcated"], outs["standard"]) < tol


def test_rows_differ_per_sample():
    """A check that the test above can fail: samples with different own KV get different outputs."""
    gen = torch.Generator().manual_seed(7)
    cache = make_cache(2, 16, 10, 5, 3, torch.float32, gen)
    q = torch.randn(1, 4, 16, generator=gen).expand(3, 4, 16).contiguous()
    k = torch.randn(3, 2, 16, generator=gen)
    v = torch.randn(3, 2, 16, generator=gen)
    out = DecodeAttention(cache, "bifurcated").attend(0, q, k, v)
    assert rel_err(out[0], out[1]) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_kernels_and_merge(dtype):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 5, 32, generator=gen).to(dtype)
    k = torch.randn(2, 3, 70, 32, generator=gen).to(dtype)
    v = torch.randn(2, 3, 70, 32, generator=gen).to(dtype)
    o_full, lse_full = attend_segment_matmul(q, k, v, 32**-0.5)
    o_fast, lse_fast = attend_segment(q, k, v)
    assert rel_err(o_fast, o_full) < TOL[dtype]
    assert torch.allclose(lse_fast, lse_full, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    # Split the keys in two segments at a random point: the merge gives the whole.
    cut = 23
    o1, l1 = attend_segment(q, k[:, :, :cut], v[:, :, :cut])
    o2, l2 = attend_segment(q, k[:, :, cut:], v[:, :, cut:])
    o, lse = merge_partials(o1, l1, o2, l2)
    assert rel_err(o, o_full) < TOL[dtype]
    assert torch.allclose(lse, lse_full, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("h,g", [(4, 4), (6, 2), (4, 1)])
def test_chunked_prefill_equals_whole(h, g):
    gen = torch.Generator().manual_seed(h * g)
    T, D = 37, 16
    q = torch.randn(T, h, D, generator=gen)
    k = torch.randn(T, g, D, generator=gen)
    v = torch.randn(T, g, D, generator=gen)
    whole = ForkedKVCache(1, g, D, T, 1, 1, torch.float32, "cpu")
    o_whole = PrefillAttention(whole, 0).attend(0, q, k, v)
    chunked = ForkedKVCache(1, g, D, T, 1, 1, torch.float32, "cpu")
    parts = [PrefillAttention(chunked, s).attend(0, q[s:e], k[s:e], v[s:e]) for s, e in [(0, 10), (10, 11), (11, 37)]]
    assert rel_err(torch.cat(parts), o_whole) < 1e-5
    # Row t of the causal result is plain attention over keys 0..t.
    t = 20
    kk = k[: t + 1].repeat_interleave(h // g, dim=1)
    vv = v[: t + 1].repeat_interleave(h // g, dim=1)
    w = torch.softmax(torch.einsum("hd,thd->ht", q[t], kk) / D**0.5, dim=-1)
    assert rel_err(o_whole[t], torch.einsum("ht,thd->hd", w, vv)) < 1e-5
