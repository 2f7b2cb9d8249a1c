"""forklm's AVX2 block kernel (GGUF Q4_1 / Q8_0 weights times Q8-quantized float32 activations)
against the slow, obvious reference; batch invariance; how the default model uses it."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import amx_tiles_expected

from forklm import backend
from forklm.backend import Backend
from forklm.kernels import block_gemm as bg
from forklm.models import quant
from forklm.models.quant import BlockLinear, BlockQuantized

pytestmark = pytest.mark.skipif(not bg.cpu_supports(), reason="the block kernel needs x86-64 with AVX2, FMA, F16C")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_blocks(kind: str, n: int, k: int, seed: int) -> BlockQuantized:
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3).half().float()
    if kind in ("q4_1", "q5_1", "q4_1_r8", "q4_0_r8", "q5_1_r8", "q5_0_r8"):
        five = kind.startswith("q5")
        q = torch.randint(0, 32 if five else 16, (n, k), generator=g, dtype=torch.uint8)
        m = {"q4_0_r8": -8 * d, "q5_0_r8": -16 * d}.get(kind)
        m = (-torch.rand(n, k // 32, generator=g) * 0.4).half().float() if m is None else m
        return BlockQuantized("q5_1" if five else "q4_1", q, d, m)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)  # -128 too: the kernel's |w| edge
    return BlockQuantized("q8_0", q, d)


# layouts over super-blocks of 256 (q4_k_r8 / q5_k_r8: K-quant scales, their activations per block of 32)
K_KINDS = ["q4_k", "q5_k", "q4_k_r8", "q5_k_r8", "q6_k", "q6_k_r8", "q3_k", "q2_k", "iq4_xs"]


def stored_q8_0_bytes(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """GGUF Q8_0 rows as a file stores them: uint8 [N, K/32·34], per block float16 d then 32 int8."""
    n, k = q.shape
    raw = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    raw[..., :2] = d.half().contiguous().view(torch.uint8).view(n, k // 32, 2)
    raw[..., 2:] = q.contiguous().view(torch.uint8).view(n, k // 32, 32)
    return raw.view(n, k // 32 * 34)


def random_weights(kind: str, n: int, k: int, seed: int) -> bg.BlockWeights:
    """Random blocks of any layout the kernel runs (K-quant scales: 6-bit integers under float16
    super-block scales, as GGUF's Q4_K / Q5_K hold them; Q3_K's signed 6-bit scales per 16, Q2_K's 4-bit
    scales and minima per 16)."""
    if kind in ("iq4_nl", "iq4_nl_r8"):
        g = torch.Generator().manual_seed(seed)
        d = (torch.rand(n, k // 32, generator=g) * 0.05 + 1e-3).half().float()
        w = bg.pack_iq4_nl(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), d)
        return bg.interleave_r8(w) if kind == "iq4_nl_r8" else w
    if kind not in K_KINDS:
        return block_weights_of(kind, random_blocks(kind, n, k, seed))
    if kind in ("q4_k_r8", "q5_k_r8", "q6_k_r8"):
        return bg.interleave_r8(random_weights(kind[:-3], n, k, seed))
    g = torch.Generator().manual_seed(seed)
    if kind == "iq4_xs":
        ds = (torch.rand(n, k // 256, generator=g) * 0.004 + 1e-4).half().float()
        return bg.pack_iq4_xs(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8), ds,
                              torch.randint(-32, 32, (n, k // 32), generator=g, dtype=torch.int8))
    if kind == "q3_k":
        q = torch.randint(-4, 4, (n, k), generator=g, dtype=torch.int8)
        ds = (torch.rand(n, k // 256, generator=g) * 0.004 + 1e-4).half().float()
        return bg.pack_q3_k(q, ds, torch.randint(-32, 32, (n, k // 16), generator=g, dtype=torch.int8))
    if kind == "q2_k":
        q = torch.randint(0, 4, (n, k), generator=g, dtype=torch.uint8)
        ds, dmin = ((torch.rand(n, k // 256, generator=g) * 0.004 + 1e-4).half().float() for _ in range(2))
        sc, mn = (torch.randint(0, 16, (n, k // 16), generator=g, dtype=torch.uint8) for _ in range(2))
        return bg.pack_q2_k(q, ds, dmin, sc, mn)
    if kind == "q6_k":
        q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
        ds = (torch.rand(n, k // 256, generator=g) * 0.001 + 1e-4).half().float()
        return bg.pack_q6_k(q, ds, torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8))
    q = torch.randint(0, 16 if kind == "q4_k" else 32, (n, k), generator=g, dtype=torch.uint8)
    ds = (torch.rand(n, k // 256, generator=g) * 0.004 + 1e-4).half().float()
    dm = (-torch.rand(n, k // 256, generator=g) * 0.01).half().float()
    sc, mq = (torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in range(2))
    w = bg.pack_k_quant(q, ds, sc, dm, mq)
    assert w.kind == kind
    return w


KINDS = ["q4_1", "q4_1_r8", "q4_0_r8", "q5_1_r8", "q5_0_r8", "q5_1", "q8_0", "q8_0_r8", "q4_k", "q5_k", "q4_k_r8",
         "q5_k_r8", "q6_k", "q6_k_r8", "q3_k", "q2_k", "iq4_nl", "iq4_nl_r8", "iq4_xs"]


@pytest.mark.parametrize("kind", K_KINDS)
@pytest.mark.parametrize("t, n, k", [(1, 64, 256), (2, 7, 512), (3, 97, 256), (4, 130, 768), (5, 3, 1536),
                                     (9, 70, 256), (33, 65, 512), (1, 1, 256)])
def test_k_quant_gemm_matches_reference(kind, t, n, k):
    w = random_weights(kind, n, k, seed=t * 1000 + n + k)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(n)) * torch.rand(t, 1) * 4
    y = bg.gemm(x, w)
    assert rel_err(y, bg.gemm_reference(x, w)) < 1e-5
    if t * n >= 16:  # (a lone dot product can cancel: its relative error is no measure)
        assert rel_err(y, x.double() @ w.dequantize().double().t()) < 0.02
    q, d, m = w.unpack()  # the K-quant scales as GGUF forms them: ds·sc (and −dmin·mq)
    if kind.endswith("_r8"):  # the same values and scales as the plain layout's
        plain = bg.deinterleave_r8(w)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip((q, d, m), plain.unpack()))
        w = plain
    if kind == "q2_k":  # d holds (ds, dmin) per super-block, sc the file's scale | minimum << 4
        ds, dmin = w.d.float().view(n, -1, 2).repeat_interleave(16, 1).unbind(-1)
        assert torch.equal(d, ds * (w.sc & 15).float()) and torch.equal(m, -(dmin * (w.sc >> 4).float()))
    else:
        assert torch.equal(d, w.d.float().repeat_interleave(d.shape[1] // w.d.shape[1], 1) * w.sc.float())


@pytest.mark.parametrize("kind", ["iq4_nl", "iq4_nl_r8"])
@pytest.mark.parametrize("t, n, k", [(1, 64, 64), (2, 7, 32), (3, 97, 576), (4, 130, 96), (5, 3, 1536),
                                     (9, 70, 160), (33, 65, 576), (1, 1, 32), (6, 17, 96)])
def test_iq4_nl_gemm_matches_reference(kind, t, n, k):
    """IQ4_NL: ggml's 16 levels looked up from the nibbles, then Q8_0's product (interleaved: the
    nibbles as Q4_0's, 8 outputs to a block)."""
    w = random_weights(kind, n, k, seed=t * 1000 + n + k)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(n)) * torch.rand(t, 1) * 4
    y = bg.gemm(x, w)
    assert rel_err(y, bg.gemm_reference(x, w)) < 1e-5
    if t * n >= 16:
        assert rel_err(y, x.double() @ w.dequantize().double().t()) < 0.02
    q, _, _ = w.unpack()
    assert set(q.unique().tolist()) <= set(bg.IQ4_NL_LEVELS.tolist())


def test_kernel_builds_here():
    assert bg.build_error() is None  # x86 CI with AVX2: a failed build must not pass silently


def block_weights_of(kind: str, b: BlockQuantized) -> bg.BlockWeights:
    """Random blocks in the kernel's layout `kind`."""
    if kind == "q4_1":  # the plain layout (what q5_1 runs with fifth bits 0); files load interleaved
        return bg.pack_q4_1(b.q, b.d, b.m)
    if kind == "q4_0_r8":
        return bg.pack_q4_0_r8(b.q, b.d)
    if kind == "q8_0":  # the plain layout; files and quantize="int8" load interleaved (q8_0_r8)
        return bg.pack_q8_0(b.q, b.d)
    if kind in ("q5_1_r8", "q5_0_r8"):
        return bg.interleave_r8(bg.pack_q5_1(b.q, b.d, b.m), minima=kind == "q5_1_r8")
    return b.to_block_weights()


@pytest.mark.parametrize("kind", ["q4_1", "q4_1_r8", "q4_0_r8", "q5_1", "q5_1_r8", "q5_0_r8", "q8_0", "q8_0_r8"])
@pytest.mark.parametrize("t, n, k", [(1, 64, 64), (2, 7, 32), (3, 97, 576), (4, 130, 96), (5, 3, 1536),
                                     (9, 70, 160), (33, 65, 576), (1, 1, 32), (6, 8, 64), (7, 17, 96)])
def test_gemm_matches_reference(kind, t, n, k):
    b = random_blocks(kind, n, k, seed=t * 1000 + n + k)
    w = block_weights_of(kind, b)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(n)) * torch.rand(t, 1) * 4
    y = bg.gemm(x, w)
    assert y.shape == (t, n) and y.dtype == torch.float32
    assert rel_err(y, bg.gemm_reference(x, w)) < 1e-5
    # and close to the float product of the dequantized weights (the activations' Q8 rounding only;
    # a lone dot product of Q4_0's symmetric weights can cancel: its relative error is no measure)
    if t * n >= 16 or kind not in ("q4_0_r8", "q5_0_r8"):
        assert rel_err(y, x.double() @ b.dequantize().double().t()) < 0.02


@pytest.mark.parametrize("kind", KINDS)
def test_each_row_depends_on_that_row_alone(kind):
    """Bit for bit: a row computed alone, in any tile position, or beside other rows."""
    k = 512 if kind in K_KINDS else 576
    w = random_weights(kind, 131, k, seed=3)
    x = torch.randn(13, k)
    together = bg.gemm(x, w)
    alone = torch.cat([bg.gemm(x[i : i + 1], w) for i in range(13)])
    assert torch.equal(together, alone)
    shuffled = torch.randperm(13)
    assert torch.equal(bg.gemm(x[shuffled], w), together[shuffled])
    assert torch.equal(bg.gemm(torch.cat([x[5:6], torch.randn(6, k)]), w)[0], together[5])


def test_activation_quantization_is_the_reference_bit_for_bit():
    x = torch.randn(6, 128) * torch.logspace(-3, 3, 6).unsqueeze(1)
    x[1] = 0.0  # an all-zero row: scale 0, values 0
    x[2, :32] = torch.tensor([127.0] + [2.5, -2.5, 0.5, -0.5, 1.5, 3.5] * 5 + [0.0])  # scale 1: ties round to even
    x[3, 32:64] = -x[3, 32:64].abs()
    for got, want in zip(bg.quantize_q8(x), bg.quantize_q8_reference(x)):
        assert torch.equal(got, want)
    q, d, _ = bg.quantize_q8(x)
    assert q[2, 1:5].tolist() == [2, -2, 0, 0] and d[1].eq(0).all() and q[1].eq(0).all()
    assert q.abs().max() <= 127


def test_vector_quantization_matches_the_scalar_rule_on_hard_rows():
    """The AVX2 quantization (8 lanes at a time) against the reference on rows built to break it:
    magnitudes from subnormal to FLT_MAX itself, a block whose scale is exactly the smallest normal
    float, exact ties at random scales, negative zeros, the block's largest value negative, and
    -inf / NaN / inf in different lanes of blocks and super-blocks."""
    g = torch.Generator().manual_seed(20261127)
    rows = []
    for scale in (1e-39, 1e-30, 1e-6, 1.0, 1e6, 1e30, 3e38 / 127):
        rows.append(torch.randn(512, generator=g) * scale)
    d = torch.rand(16, generator=g) + 0.5  # ties: values (k + 1/2)·d with the block's max 127·d exact
    ties = (torch.randint(-127, 127, (16, 32), generator=g) + 0.5) * d.unsqueeze(1)
    ties[:, 0] = -127 * d  # the largest magnitude negative: d = 127·d / 127
    rows.append(ties.reshape(512))
    neg_zero = torch.randn(512, generator=g)
    neg_zero[::3] = -0.0
    rows.append(neg_zero)
    x = torch.stack(rows)
    big, tiny = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny
    x[6, 40], x[6, 300] = big, -big  # finite: scale FLT_MAX / 127, values ±127
    x[0, 64:96] = torch.rand(32, generator=g) * tiny * 127  # below the smallest normal scale: zeros
    x[0, 70] = 127 * tiny  # ... but this one brings the block's scale to exactly FLT_MIN: quantized
    x[1, 37] = float("-inf")
    x[2, 300] = float("nan")
    x[4, 263] = float("inf")
    x[5, 511] = float("nan")
    q8, d8, s8 = bg.quantize_q8(x)
    for got, want in zip((q8, d8, s8), bg.quantize_q8_reference(x)):
        assert torch.equal(got.nan_to_num(-7.0), want.nan_to_num(-7.0))
    q, dd, sums = bg.quantize_q8_k(x)
    want = bg.quantize_q8_k_reference(x)
    assert torch.equal(q, want[0]) and torch.equal(sums, want[2])
    assert torch.equal(dd.nan_to_num(-7.0), want[1].nan_to_num(-7.0))
    assert d8[1, 1].isnan() and q[1, :256].eq(0).all() and dd[1, 0].isnan()
    assert d8[0, 2] == tiny and q8[0, 70] == 127 and q8[0, :64].eq(0).all()  # the FLT_MIN edge, either side
    assert q8[6, 40] == 127 and q8[6, 300] == -127 and torch.isfinite(d8[6]).all()


def test_super_block_quantization_is_the_reference_bit_for_bit():
    """Q6_K weights take activations quantized per 256 with the sums of each 16 (ggml's Q8_K)."""
    x = torch.randn(5, 768) * torch.logspace(-3, 3, 5).unsqueeze(1)
    x[1, 256:512] = 0.0  # an all-zero super-block: scale 0, values and sums 0
    x[2, :256] = 2.5  # scale 2.5 / 127: every value rounds to 127
    x[3, 300] = float("nan")  # a NaN: that super-block's scale NaN, values and sums 0
    q, d, sums = bg.quantize_q8_k(x)
    want = bg.quantize_q8_k_reference(x)
    assert torch.equal(q, want[0]) and torch.equal(sums, want[2])
    assert torch.equal(d.nan_to_num(-1.0), want[1].nan_to_num(-1.0))
    assert d.shape == (5, 3) and sums.shape == (5, 48) and sums.dtype == torch.int16
    assert d[1, 1] == 0 and q[1, 256:512].eq(0).all() and sums[1, 16:32].eq(0).all()
    assert q[2, :256].eq(127).all() and sums[2, :16].eq(16 * 127).all()
    assert d[3, 1].isnan() and q[3, 256:512].eq(0).all() and sums[3, 16:32].eq(0).all()
    assert not d[3, 0].isnan() and not d[3, 2].isnan()  # only the super-block holding it


def test_q6_k_integer_sums_do_not_overflow_at_the_extremes():
    """Every value 63 (the file's +31) or 0 under scale ±128 / 127 against activations at ±127: the
    int16 pair sums and int32 super-block sums the kernel forms stay in range (against the float64
    reference)."""
    n, k = 16, 512
    for value, scale in ((31, 127), (-32, -128), (31, -128)):
        q = torch.full((n, k), value, dtype=torch.int8)
        w = bg.pack_q6_k(q, torch.full((n, k // 256), 1e-3).half().float(), torch.full((n, k // 16), scale, dtype=torch.int8))
        x = torch.where(torch.rand(3, k) < 0.5, -1.0, 1.0) * 5.0
        x[0] = 5.0  # all +127
        for layout in (w, bg.interleave_r8(w)):  # (q6_k_r8: per 16 values, int16 pairs of two runs in the AVX2 build)
            assert rel_err(bg.gemm(x, layout), bg.gemm_reference(x, layout)) < 1e-6


def test_4_bit_integer_sums_do_not_overflow_at_the_extremes():
    """Interleaved Q4_0 / Q4_1 / Q5_0 / Q5_1: every value at its largest (or 0) against activations at
    ±127 puts each int16 sum of byte-pair products at its largest (4-bit: 8 · 2 · 15 · 127 = 30480; 5-bit,
    two runs at a time: 4 · 2 · 31 · 127 = 31496): no saturation."""
    n, k = 19, 256
    d = torch.full((n, k // 32), 1e-3).half().float()
    for value in (15, 0):
        q = torch.full((n, k), value, dtype=torch.uint8)
        q5 = q * 31 // 15  # 31 or 0: the 5-bit sums at their largest (4 · 2 · 31 · 127 per int16 pass)
        for w in (bg.pack_q4_0_r8(q, d), bg.pack_q4_1_r8(q, d, torch.full_like(d, -0.25)),
                  bg.interleave_r8(bg.pack_q5_1(q5, d, -16 * d), minima=False),
                  bg.interleave_r8(bg.pack_q5_1(q5, d, torch.full_like(d, -0.25)))):
            x = torch.where(torch.rand(3, k) < 0.5, -1.0, 1.0) * 5.0
            x[0] = 5.0  # all +127
            assert rel_err(bg.gemm(x, w), bg.gemm_reference(x, w)) < 1e-6


def test_interleaved_blocks_keep_the_values_and_their_rows():
    """q4_0_r8 / q4_1_r8 hold the same values as the plain layout, row lookups included, for output
    counts that leave the last group of 8 short."""
    for n in (1, 7, 8, 21):
        b = random_blocks("q4_1_r8", n, 96, seed=n)
        plain = bg.pack_q4_1(b.q, b.d, b.m)
        w = b.to_block_weights()
        assert w.kind == "q4_1_r8" and w.qs.shape == ((n + 7) // 8, 3, 128)
        assert torch.equal(w.dequantize(), plain.dequantize()) and torch.equal(w.dequantize(), b.dequantize())
        ids = torch.tensor([n - 1, 0, n // 2])
        assert torch.equal(w.rows(ids).dequantize(), b.dequantize()[ids])
        w0 = bg.pack_q4_0_r8(b.q, b.d)
        assert w0.m is None and torch.equal(w0.dequantize(), b.d.repeat_interleave(32, 1) * (b.q.float() - 8))
        assert torch.equal(w0.rows(ids).dequantize(), w0.dequantize()[ids])
        b5 = random_blocks("q5_1_r8", n, 96, seed=n)
        w5 = block_weights_of("q5_1_r8", b5)
        assert w5.kind == "q5_1_r8" and w5.qh.shape == ((n + 7) // 8, 3, 32)
        assert torch.equal(w5.dequantize(), b5.dequantize())
        assert torch.equal(w5.rows(ids).dequantize(), b5.dequantize()[ids])
        assert torch.equal(bg.deinterleave_r8(w5).qh, bg.pack_q5_1(b5.q, b5.d, b5.m).qh)
    with pytest.raises(ValueError, match="only q4_1 / q5_1 / q8_0 / iq4_nl / q4_k / q5_k / q6_k blocks"):
        bg.interleave_r8(random_weights("q3_k", 8, 256, seed=1))


def test_interleaved_signed_blocks_keep_the_values_and_their_rows():
    """q8_0_r8 / iq4_nl_r8 hold the plain layouts' values (−128 included), row lookups too, for output
    counts that leave the last group of 8 short, and GGUF Q8_0 / IQ4_NL bytes repack straight into them
    (a permuted row order gathered in the pass)."""
    for n in (1, 7, 8, 21):
        b = random_blocks("q8_0", n, 96, seed=n)
        w = b.to_block_weights()
        assert w.kind == "q8_0_r8" and w.qs.shape == ((n + 7) // 8, 3, 256) and w.qs.dtype == torch.int8
        assert torch.equal(w.dequantize(), b.dequantize()) and torch.equal(bg.deinterleave_r8(w).qs, b.q)
        ids = torch.tensor([n - 1, 0, n // 2])
        assert torch.equal(w.rows(ids).dequantize(), b.dequantize()[ids])
        order = torch.randperm(n, generator=torch.Generator().manual_seed(n))
        raw = stored_q8_0_bytes(b.q, b.d)[order].contiguous()  # stored row i holds output order[i]
        qs, d = torch.zeros_like(w.qs), torch.zeros_like(w.d)  # (the caller zeroes a short last group)
        bg.repack_rows("Q8_0", raw, 0, qs, d, order=torch.argsort(order), outputs=n)
        assert torch.equal(qs, w.qs) and torch.equal(d, w.d)
        nl = random_weights("iq4_nl", n, 96, seed=n)
        r8 = bg.interleave_r8(nl)
        assert r8.kind == "iq4_nl_r8" and r8.qs.shape == ((n + 7) // 8, 3, 128)
        assert torch.equal(r8.dequantize(), nl.dequantize()) and torch.equal(bg.deinterleave_r8(r8).qs, nl.qs)
        assert torch.equal(r8.rows(ids).dequantize(), nl.dequantize()[ids])
        stored = torch.cat([nl.d.view(torch.uint8).view(n, 3, 2), nl.qs.view(n, 3, 16)], -1).view(n, 54).contiguous()
        qs, d = torch.zeros_like(r8.qs), torch.zeros_like(r8.d)
        bg.repack_rows("IQ4_NL", stored, 0, qs, d, outputs=n)
        assert torch.equal(qs, r8.qs) and torch.equal(d, r8.d)
    # parts fused along N, the second starting inside a group and stored in a permuted order
    b = random_blocks("q8_0", 37, 64, seed=5)
    w = b.to_block_weights()
    qs, d = torch.zeros_like(w.qs), torch.zeros_like(w.d)
    raw = stored_q8_0_bytes(b.q, b.d)
    order = torch.randperm(32, generator=torch.Generator().manual_seed(2))
    bg.repack_rows("Q8_0", raw[:5].contiguous(), 0, qs, d, outputs=37)
    bg.repack_rows("Q8_0", raw[5:][order].contiguous(), 5, qs, d, order=torch.argsort(order), outputs=37)
    assert torch.equal(qs, w.qs) and torch.equal(d, w.d)
    with pytest.raises(RuntimeError, match="need the output count"):
        bg.repack_rows("Q8_0", raw, 0, qs, d)
    with pytest.raises(RuntimeError, match="interleaved qs / d"):  # a 4-bit shape for Q8_0's values
        bg.repack_rows("Q8_0", raw, 0, torch.zeros(5, 2, 128, dtype=torch.int8), d, outputs=37)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match=r"\[5, 2, 256\]"):
        bg._extension().gemm_q8_0_r8(x, torch.zeros(5, 2, 128, dtype=torch.int8), w.d, w.count, 0, None, 0.0, None)
    with pytest.raises(RuntimeError, match="output count N"):
        bg._extension().gemm_q8_0_r8(x, w.qs, w.d, torch.tensor([37, 1]), 0, None, 0.0, None)
    with pytest.raises(RuntimeError, match="scales d"):
        bg._extension().gemm_q8_0_r8(x, w.qs, w.d[:, :1].contiguous(), w.count, 0, None, 0.0, None)
    with pytest.raises(IndexError, match="asked of 37"):
        w.rows(torch.tensor([0, 37]))  # a padding lane of the last group is no row
    assert bg.repack_rows("Q8_0", raw[:0], 0, torch.zeros(0, 2, 256, dtype=torch.int8),
                          torch.zeros(0, 2, 8, dtype=torch.float16), outputs=0) == 0
    with pytest.raises(RuntimeError, match="interleaved only"):
        bg.repack_rows("Q8_0", stored_q8_0_bytes(b.q, b.d), 0, torch.empty(21, 96, dtype=torch.int8),
                       torch.empty(21, 3, dtype=torch.float16))


def test_signed_integer_sums_do_not_overflow_at_the_extremes():
    """Interleaved Q8_0: weights at −128 / 127 against activations at ±127 put each int16 pair of byte
    products at its largest (2 · 128 · 127 = 32512): no saturation; IQ4_NL's levels at −127 / 113."""
    n, k = 19, 256
    d = torch.full((n, k // 32), 1e-3).half().float()
    for value in (-128, 127, 0):
        w = bg.pack_q8_0_r8(torch.full((n, k), value, dtype=torch.int8), d)
        nl = bg.interleave_r8(bg.pack_iq4_nl(torch.full((n, k), 0 if value < 0 else 15, dtype=torch.uint8), d))
        for ww in (w, nl):
            x = torch.where(torch.rand(3, k) < 0.5, -1.0, 1.0) * 5.0
            x[0] = 5.0  # all +127
            x[1] = -5.0  # all −127
            y = bg.gemm(x, ww)
            assert torch.equal(y, bg.gemm_reference(x, ww)) or rel_err(y, bg.gemm_reference(x, ww)) < 1e-6


def test_block_weights_round_trip_the_gguf_values():
    for kind in ("q4_1", "q5_1", "q8_0"):
        b = random_blocks(kind, 40, 96, seed=7)
        w = b.to_block_weights()
        assert torch.equal(w.dequantize(), b.dequantize())  # the float loader's values, bit for bit
        q, d, m = w.unpack()
        assert torch.equal(q.view(torch.uint8), b.q.view(torch.uint8)) and torch.equal(d, b.d)
        assert (m is None) == (b.m is None) and (m is None or torch.equal(m, b.m))
    with pytest.raises(ValueError, match="not a float16 value"):
        bg.pack_q8_0(torch.zeros(2, 32, dtype=torch.int8), torch.full((2, 1), 0.1))


def test_weight_rows_keep_their_minima():
    """`rows` picks outputs from the grouped minima layout ([ceil(N/8), K/32, 8]) as from the others."""
    b = random_blocks("q4_1", 45, 96, seed=11)
    w = b.to_block_weights()
    assert w.m.shape == (6, 3, 8) and w.m[5, :, 5:].eq(0).all()  # 45 outputs: the last group padded
    ids = torch.tensor([44, 0, 9, 9, 31, 8, 17])
    picked = w.rows(ids)
    assert picked.m.shape == (1, 3, 8)
    assert torch.equal(picked.dequantize(), b.dequantize()[ids])
    x = torch.randn(3, 96)
    assert torch.equal(bg.gemm(x, picked), bg.gemm(x, w)[:, ids])


def test_threads_do_not_change_the_bits():
    w = random_blocks("q4_1", 203, 160, seed=13).to_block_weights()
    x = torch.randn(6, 160)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [bg.gemm(x, w), bg.gemm(x[:1], w)]
        torch.set_num_threads(2)
        two = [bg.gemm(x, w), bg.gemm(x[:1], w)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(one[0][:1], one[1])


@pytest.mark.parametrize("t, b, n, k", [(1, 1, 8, 96), (9, 1, 16, 2048), (7, 16, 40, 128), (5, 3, 17, 37)])
def test_dense_rows_is_each_rows_own_product(t, b, n, k):
    """`dense_rows` (the float32 products around quantized ones: a router, W_UK / W_UV): close to a
    float64 einsum, and every row's numbers the same whichever rows come with it, alone included, on
    one thread or two (PyTorch's own products change kernels with the row count)."""
    g = torch.Generator().manual_seed(t * 1000 + k)
    x, w = torch.randn(t, b, k, generator=g), torch.randn(b, n, k, generator=g)
    y = bg.dense_rows(x, w)
    ref = torch.einsum("tbk,bnk->tbn", x.double(), w.double())
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(bg.dense_rows(x, w), y)
            for i in range(t):
                assert torch.equal(bg.dense_rows(x[i : i + 1], w)[0], y[i])
            assert torch.equal(bg.dense_rows(x[1:], w), y[1:])
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="w must be float32"):
        bg.dense_rows(x, w[:, :, 1:])


def test_bad_shapes_are_refused_by_name():
    w = random_blocks("q4_1", 8, 64, seed=1).to_block_weights()
    with pytest.raises(RuntimeError, match="block values"):
        bg.gemm(torch.randn(2, 96), w)  # K does not match the weights
    with pytest.raises(RuntimeError, match="multiple of 32"):
        bg.gemm(torch.randn(2, 40), w)
    with pytest.raises(RuntimeError, match="float32"):
        bg.gemm(torch.randn(2, 64, dtype=torch.float64), w)
    assert bg.gemm(torch.randn(0, 64), w).shape == (0, 8)


def test_block_linear_runs_the_kernel_at_every_row_count_and_keeps_no_dense_copy():
    b = random_blocks("q4_1", 64, 128, seed=5)
    lin = BlockLinear(b.to_block_weights(), torch.float32)
    assert lin.dense is None and lin.num_bytes() == lin.blocks.num_bytes()
    x = torch.randn(300, 128)
    full = lin(x)
    assert torch.equal(full, bg.gemm(x, lin.blocks))
    for i in (0, 7, 299):  # a row's result is the same bits alone as among 300
        assert torch.equal(lin(x[i:i + 1])[0], full[i])


def test_block_linear_with_a_dense_copy_switches_above_max_rows():
    """The opt-in dense copy (no GGUF file's default path keeps one)."""
    b = random_blocks("q4_1", 64, 128, seed=5)
    lin = BlockLinear(b.to_block_weights(), torch.float32, max_rows=4, keep_dense=True)
    assert torch.equal(lin.dense, b.dequantize())
    x = torch.randn(6, 128)
    assert torch.equal(lin(x[:4]), bg.gemm(x[:4], lin.blocks))  # kernel
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.dense))  # dense above 4 rows
    bias = torch.randn(64)
    assert torch.allclose(lin(x[:2], bias), bg.gemm(x[:2], lin.blocks) + bias)
    assert lin.kernel_tensors() == lin.blocks.tensors() and lin.num_bytes() > lin.blocks.num_bytes()


def test_default_model_runs_its_gguf_blocks_on_the_kernel(smollm2_gguf, smollm2_f32):
    """SmolLM2's file: layers Q4_1, tied embedding / LM head Q8_0, all kept as stored (no re-rounding)."""
    from forklm import LLM
    from tests.test_quant import model_logits

    llm = LLM("smollm2-135m", dtype="float32", device="cpu", quantize="auto")
    m, ref = llm.model, smollm2_f32.model
    assert llm.backend.block_kernel and backend.block_kernel_available()
    assert m.layers[0]["qkv"].kind == "q4_1_r8" and m.lm_head.kind == "q8_0_r8"
    assert m.embed is None and m.lm_head.dense is None  # weights resident once: no dense copies
    want = ref.layers[5]["gate_up"]
    want = want.t() if ref.weight_layout == "in_out" else want
    assert torch.equal(m.layers[5]["gate_up"].dequantize(), want)  # the file's values exactly
    ids = torch.randint(0, ref.embed.shape[0], (37,))
    rows = m._embed_rows(ids)  # what forward looks up: rows of the head's Q8_0 blocks
    assert rows.dtype == torch.float32 and torch.equal(rows, ref.embed[ids])  # exact
    ids = torch.tensor(smollm2_f32.tokenizer.encode("The capital of France is Paris. The capital of Germany is"))
    ref_prefill, ref_steps = model_logits(ref, ids[:-4], ids[-4:])
    prefill, steps = model_logits(m, ids[:-4], ids[-4:])
    # 13 prompt rows and 1-row steps: both on the kernel (Q8 activations; the bfloat16-activation
    # int4 path this replaced was held to 0.08)
    assert rel_err(prefill, ref_prefill) < 0.06 and rel_err(steps, ref_steps) < 0.06
    assert (prefill.argmax(-1) == ref_prefill.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("t", [1, 3, 6])
def test_fused_prologues_and_residual_match_their_operators(kind, t):
    """RMSNorm and SwiGLU before the quantization, the residual add after: against the same steps
    as separate PyTorch operators (the quantization of nearly equal rows may differ by a step at a
    rounding boundary: a tolerance, not bit equality)."""
    g = torch.Generator().manual_seed(t)
    k = 256 if kind in K_KINDS else 128  # K-quants: activations quantized per 256
    w = random_weights(kind, 96, k, seed=t)
    x = torch.randn(t, k, generator=g) * 3
    norm = torch.rand(k, generator=g) + 0.5
    res = torch.randn(t, 96, generator=g)
    fused = bg.gemm(x, w, norm_weight=norm, eps=1e-5, residual=res)
    assert rel_err(fused, bg.gemm_reference(x, w, norm_weight=norm, eps=1e-5, residual=res)) < 1e-3
    xn = norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert rel_err(bg.gemm(x, w, norm_weight=norm, eps=1e-5), bg.gemm(xn, w)) < 1e-3
    gu = torch.randn(t, 2 * k, generator=g) * 2
    gate, up = gu.chunk(2, dim=-1)
    swi = bg.gemm(gu, w, swiglu=True)
    assert rel_err(swi, bg.gemm_reference(gu, w, swiglu=True)) < 1e-3
    assert rel_err(swi, bg.gemm(torch.nn.functional.silu(gate) * up, w)) < 1e-3
    plain = bg.gemm(x, w)
    assert torch.equal(bg.gemm(x, w, residual=res), res + plain)  # the add rounds once, as `res + y`
    alone = torch.cat([bg.gemm(gu[i : i + 1], w, swiglu=True) for i in range(t)])
    assert torch.equal(alone, swi)  # still one row at a time
    with pytest.raises(RuntimeError, match="rms_norm weight"):
        bg.gemm(x, w, norm_weight=torch.rand(k // 2), eps=1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        bg.gemm(x, w, residual=torch.randn(t, 95))


@pytest.mark.parametrize("kind", K_KINDS)
def test_k_quant_rows_with_nan_or_tiny_values_stay_in_their_super_block(kind):
    """A NaN in one super-block makes its row NaN (as a dense product would) and leaves the other
    rows alone; a row of subnormal values quantizes to zeros and gives the minima-free zero product."""
    w = random_weights(kind, 24, 512, seed=5)
    x = torch.randn(4, 512)
    x[1, 300] = float("nan")
    x[2] = 1e-40  # below the smallest normal float: scale 0, values 0
    y = bg.gemm(x, w)
    assert y[1].isnan().all() and not y[[0, 3]].isnan().any()
    assert torch.equal(y[2], torch.zeros(24))
    assert torch.equal(y[[0, 3]], bg.gemm(x[[0, 3]], w))
    ref = bg.gemm_reference(x[[0, 3]], w)
    assert rel_err(y[[0, 3]], ref) < 1e-5


def test_q3_k_q2_k_integer_sums_do_not_overflow_at_the_extremes():
    """Q3_K values at 3 / −4 under scales ±31 / −32, Q2_K's at 3 under scale and minimum 15, against
    activations at ±127: the integer sums stay in range (against the float64 reference)."""
    n, k = 16, 512
    x = torch.where(torch.rand(3, k) < 0.5, -1.0, 1.0) * 5.0
    x[0] = 5.0  # all +127
    ds = torch.full((n, k // 256), 1e-3).half().float()
    for value, scale in ((3, 31), (-4, -32), (3, -32)):
        w = bg.pack_q3_k(torch.full((n, k), value, dtype=torch.int8), ds, torch.full((n, k // 16), scale, dtype=torch.int8))
        assert rel_err(bg.gemm(x, w), bg.gemm_reference(x, w)) < 1e-6
    full = torch.full((n, k // 16), 15, dtype=torch.uint8)
    w = bg.pack_q2_k(torch.full((n, k), 3, dtype=torch.uint8), ds, ds * 2, full, full)
    assert rel_err(bg.gemm(x, w), bg.gemm_reference(x, w)) < 1e-6


def test_iq4_xs_integer_sums_do_not_overflow_at_the_extremes():
    """IQ4_XS levels at −127 and 113 under scales −32 and 31 against activations at ±127: the int16
    pair sums (|w|·|x| <= 127·127, two a lane) and the int32 super-block sums stay in range, and each
    lane stays below 2²⁴ (converted to float exactly)."""
    n, k = 16, 512
    x = torch.where(torch.rand(3, k) < 0.5, -1.0, 1.0) * 5.0
    x[0] = 5.0  # all +127
    x[1] = -5.0  # all -127
    ds = torch.full((n, k // 256), 1e-3).half().float()
    for level, scale in ((0, -32), (0, 31), (15, -32), (15, 31)):  # levels −127 and 113
        q = torch.full((n, k), level, dtype=torch.uint8)
        w = bg.pack_iq4_xs(q, ds, torch.full((n, k // 32), scale, dtype=torch.int8))
        assert rel_err(bg.gemm(x, w), bg.gemm_reference(x, w)) < 1e-6
    with pytest.raises(ValueError, match="-32..31"):
        bg.pack_iq4_xs(torch.zeros(n, k, dtype=torch.uint8), ds, torch.full((n, k // 32), 32, dtype=torch.int8))
    with pytest.raises(ValueError, match="256"):
        bg.pack_iq4_xs(torch.zeros(n, 288, dtype=torch.uint8), ds, torch.zeros(n, 9, dtype=torch.int8))


@pytest.mark.parametrize("five", [False, True])
def test_q4_k_q5_k_integer_sums_do_not_overflow_at_the_extremes(five):
    """Values at their largest (15 / 31) under scale 63 and minimum 63 against activations at ±127:
    the int16 pair sums and int32 super-block sums stay in range (against the float64 reference)."""
    n, k = 16, 512
    top = 31 if five else 15
    q = torch.full((n, k), top, dtype=torch.uint8)
    q[::2, ::3] = 0
    full = torch.full((n, k // 32), 63, dtype=torch.uint8)
    w = bg.pack_k_quant(q, torch.full((n, k // 256), 1e-3).half().float(), full,
                        torch.full((n, k // 256), -1e-3).half().float(), full)
    assert w.kind == ("q5_k" if five else "q4_k")
    x = torch.where(torch.rand(3, k) < 0.5, -1.0, 1.0) * 5.0
    x[0] = 5.0  # every activation +127
    assert rel_err(bg.gemm(x, w), bg.gemm_reference(x, w)) < 1e-6


def test_kernel_can_be_turned_off_and_gguf_falls_back_to_pytorch_int4():
    import subprocess
    import sys

    code = ("import torch; from forklm.models import quant; from forklm.kernels import block_gemm as bg; "
            "print(bg.build_error()); "
            "from forklm.models.quant import BlockQuantized; "
            "b = BlockQuantized('q4_1', torch.randint(0, 16, (64, 64), dtype=torch.uint8), torch.full((64, 2), 0.01), "
            "torch.full((64, 2), -0.05)); "
            "from forklm.backend import Backend; "
            "w = quant.build_matrix([b], 'gguf', Backend.exact(torch.float32, torch.device('cpu'), 'gguf')); print(w.kind)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False,
                         env={**__import__("os").environ, "FORKLM_BLOCK_KERNEL": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["disabled by FORKLM_BLOCK_KERNEL=0", "int4"]
    b = random_blocks("q4_1", 64, 64, seed=2)
    assert quant.build_matrix([b], "gguf", Backend.exact(torch.float32, torch.device("cpu"), "gguf")).kind == "q4_1_r8"  # here: on


def test_int4_from_a_float_checkpoint_runs_as_q4_1_blocks():
    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(4)) * 0.05
    w[3, :32] = 0.125  # a constant block: d = 0, exact
    b = quant.q4_1_from_float(w)
    assert b.q.max() <= 15 and torch.equal(b.d, b.d.half().float()) and torch.equal(b.m, b.m.half().float())
    deq = b.dequantize()
    assert torch.equal(deq[3, :32], w[3, :32])
    lo = w.view(70, 3, 32).amin(-1)
    bound = (b.d / 2 + (b.m - lo).abs() + 1e-6).repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= bound).all()  # each value within half a step (and m's float16 rounding)
    lin = quant.build_matrix([w], "int4", Backend.exact(torch.float32, torch.device("cpu"), "int4"))
    assert isinstance(lin, BlockLinear) and lin.kind == "q4_1_r8" and lin.dense is None
    assert torch.equal(lin.dequantize(), deq)
    x = torch.randn(5, 96)
    assert rel_err(lin(x), bg.gemm_reference(x, lin.blocks)) < 1e-5
    many = torch.randn(200, 96)  # many rows: still the kernel, float32 rows in and out
    y = lin(many)
    assert y.dtype == torch.float32 and rel_err(y, bg.gemm_reference(many, lin.blocks)) < 1e-5
    # bfloat16 models keep PyTorch's int4 kernel
    assert quant.build_matrix([w], "int4", Backend.exact(torch.bfloat16, torch.device("cpu"), "int4")).kind == "int4"


@pytest.mark.parametrize("kind", ["q4_1", "q5_1", "q8_0", "q8_0_r8"])
def test_non_finite_activations_reach_the_output_and_tiny_blocks_are_zero(kind):
    w = block_weights_of(kind, random_blocks(kind, 40, 64, seed=9))
    x = torch.randn(4, 64)
    x[1, 5] = float("nan")
    x[2, 40] = float("inf")
    x[3, :32] = 1e-39  # a subnormal block: its scale's reciprocal would overflow
    y = bg.gemm(x, w)
    assert y[1].isnan().all() and y[2].isnan().all()  # as a dense product's rows would be
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[3]).all()
    for got, want in zip(bg.quantize_q8(x), bg.quantize_q8_reference(x)):
        assert torch.equal(got, want) or torch.allclose(got, want, equal_nan=True, atol=0, rtol=0)
    assert bg.quantize_q8(x)[0][3, :32].eq(0).all()
    assert rel_err(y[3:], bg.gemm_reference(x[3:], w)) < 1e-5


def test_step_breakdown_bench_counts_the_kernel_calls(smollm2_gguf):
    from bench.block_kernel_step import measure

    (row,) = measure([(40, 2)], profile=True)
    layers = 30  # SmolLM2-135M: 4 products a layer and the LM head each step
    assert row["block_kernel"] and row["step_ms"] > 0 and row["torch_ops_per_step"] > 0
    assert row["kernel_ms_per_step"] < row["step_ms"] and row["sampler_ms_per_step"] > 0
    if row["decode_stack"]:  # every decode step's layers in one call, the LM head on its own
        assert row["decode_stack_calls_per_step"] == pytest.approx(1, rel=0.05) and row["kernel_calls_per_step"] >= 1
        assert row["decode_stack_ms_per_step"] + row["kernel_ms_per_step"] < row["step_ms"]
    else:  # decode steps run attention as one C++ call a layer (prefill: PyTorch's path)
        assert row["kernel_calls_per_step"] >= 4 * layers + 1
        assert row["cpu_attention"] and row["cpu_attention_calls_per_step"] == pytest.approx(layers, rel=0.05)


@pytest.mark.skipif(not bg.uses_vnni(), reason="this CPU has no AVX512-VNNI: the kernel runs its AVX2 build")
@pytest.mark.parametrize("kind", KINDS)
def test_vnni_build_equals_the_avx2_build_bit_for_bit(kind):
    """The AVX512-VNNI variant sums the same integers in fewer instructions: every product, plain
    and fused, equals the AVX2 build's bit for bit (at every tile shape: rows 1-5 and 9). The interleaved
    K-quant layouts excepted (`bg.K_R8_KINDS`): the AVX2 build quantizes their activations per 256, the VNNI
    build per 32 (`bg.activation_block`), so there each build matches its own reference."""
    avx2 = bg.load_cpu_extension("forklm_block_gemm", bg._SOURCE)
    vnni = bg._extension()
    assert avx2 is not vnni and "vnni" in vnni.__name__  # the VNNI build, not a silent fallback
    k = 768 if kind in K_KINDS else 640
    w = random_weights(kind, 197, k, seed=11)
    for t in (1, 2, 3, 4, 5, 9):
        x = torch.randn(t, k) * 3
        res = torch.randn(t, 197)
        args = w.kernel_arrays()
        fn = f"gemm_{kind}"
        for mode, nw, r in ((bg.PLAIN, None, None), (bg.RMS_NORM, torch.rand(k) + 0.5, res)):
            a = getattr(avx2, fn)(x, *args, mode, nw, 1e-5, r)
            b = getattr(vnni, fn)(x, *args, mode, nw, 1e-5, r)
            if kind in bg.K_R8_KINDS:
                for y, on_vnni in ((a, False), (b, True)):
                    want = bg.gemm_reference(x, w, norm_weight=nw, eps=1e-5, residual=r, vnni=on_vnni)
                    assert rel_err(y, want) < 1e-5, (t, mode, on_vnni)
                assert not torch.equal(a, b)  # (per 256 against per 32: the builds differ here, by design)
            else:
                assert torch.equal(a, b), (t, mode)
        assert torch.equal(bg.gemm(x, w), getattr(vnni if kind in bg.K_R8_KINDS else avx2, fn)(x, *args, bg.PLAIN, None,
                                                                                             0.0, None))


AMX_KINDS = [k for k in bg.R8_KINDS if k != "q6_k_r8"]  # Q6_K (scales per 16) keeps the vector tiles


@pytest.mark.skipif(not amx_tiles_expected(), reason="no AMX-INT8, no AVX512-VNNI, or Linux before 5.16")
@pytest.mark.parametrize("kind", AMX_KINDS)
def test_amx_tiles_equal_the_vector_tiles_bit_for_bit(kind):
    """On a CPU with AMX-INT8 the VNNI build runs products of AMX_MIN_ROWS to AMX_MAX_ROWS rows on the tile unit:
    every product, plain and fused (RMSNorm prologue, residual), equals the vector tiles' bit for bit, at
    row counts around the 16-row tiles (padding rows) and with an odd last group of 8 outputs (it stays on
    the vector tiles), and against the slow reference."""
    ext = bg._extension()
    assert ext.amx_supported(), "an AMX-INT8 CPU on Linux >= 5.16 whose block kernel cannot use the tiles"
    assert bg.uses_amx()
    k = 768 if kind in K_KINDS else 640
    try:
        for n in (197, 16, 40):
            w = random_weights(kind, n, k, seed=n)
            args = w.kernel_arrays()
            fn = getattr(ext, f"gemm_{kind}")
            for t in (1, 5, ext.AMX_MIN_ROWS, 17, ext.AMX_MAX_ROWS, 33):
                x, res, nw = torch.randn(t, k) * 3, torch.randn(t, n), torch.rand(k) + 0.5
                for mode, norm, r in ((bg.PLAIN, None, None), (bg.RMS_NORM, nw, res)):
                    ext.set_amx(False)
                    vector = fn(x, *args, mode, norm, 1e-5, r)
                    ext.set_amx(True)
                    tiles = fn(x, *args, mode, norm, 1e-5, r)
                    assert torch.equal(tiles, vector), (n, t, mode)
                    assert tiles.isfinite().all()
            x = torch.randn(21, k)
            assert rel_err(bg.gemm(x, w), bg.gemm_reference(x, w)) < 1e-5
    finally:
        ext.set_amx(True)


def test_amx_switch_follows_the_environment():
    """FORKLM_BLOCK_KERNEL_AMX=0 turns the tiles off in a new process; elsewhere they run exactly where the
    CPU has AMX-INT8, the VNNI build loaded and Linux grants the tile data."""
    import subprocess
    import sys

    code = "from forklm.kernels import block_gemm as b; print(b.available(), b.uses_amx())"
    for value, want_amx in (("0", False), ("1", amx_tiles_expected())):
        env = dict(os.environ, FORKLM_BLOCK_KERNEL_AMX=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        available, amx = out.split()
        assert available == "True" and amx == str(want_amx), (value, out)


@pytest.mark.parametrize("kind", KINDS)
def test_every_row_count_gives_each_row_its_lone_products_bit_for_bit(kind):
    """Row counts take different tiles (8-row tiles in the VNNI build's 4- to 6-bit interleaved layouts,
    4-row tiles, then 3, 2 or a lone row's own loop, paired
    activations for Q4_1-type blocks): every product, plain and fused, gives each row the bits that
    row gets alone, with an odd number of blocks (the last one alone) and against the slow reference."""
    for k in ((256, 768) if kind in K_KINDS else (160, 640)):
        w = random_weights(kind, 197, k, seed=k)
        args = w.kernel_arrays()
        fn = getattr(bg._extension(), f"gemm_{kind}")
        x_all, res_all, nw = torch.randn(32, k) * 3, torch.randn(32, 197), torch.rand(k) + 0.5
        for mode, norm, res in ((bg.PLAIN, None, None), (bg.RMS_NORM, nw, res_all)):
            alone = torch.cat([fn(x_all[i:i + 1], *args, mode, norm, 1e-5, None if res is None else res[i:i + 1])
                               for i in range(32)])
            for t in (2, 3, 4, 5, 6, 7, 8, 9, 13, 32):
                y = fn(x_all[:t], *args, mode, norm, 1e-5, None if res is None else res[:t])
                assert torch.equal(y, alone[:t]), (k, t, mode)
        assert rel_err(bg.gemm(x_all, w), bg.gemm_reference(x_all, w)) < 1e-5


def test_a_q8_0_file_runs_interleaved_in_memory_of_its_own(smollm2_gguf):
    """A GGUF file's Q8_0 tensors (SmolLM2's tied LM head) are repacked once into q8_0_r8, outside the
    file's mapping, holding the file's values: its products are the plain layout's to rounding (the
    plain tile sums 8 lanes per output before its float step, the interleaved one a block: other bits)."""
    import os

    from forklm import LLM

    path = os.path.realpath(smollm2_gguf)
    head = LLM(path, dtype="float32", device="cpu").model.lm_head
    assert head.kind == "q8_0_r8" and head.blocks.qs.shape[2] == 256
    address = head.blocks.qs.data_ptr()
    regions = [line.split() for line in open("/proc/self/maps")]
    owner = [r for r in regions if int(r[0].split("-")[0], 16) <= address < int(r[0].split("-")[1], 16)]
    assert owner and (len(owner[0]) < 6 or os.path.realpath(owner[0][-1]) != path)
    plain = bg.deinterleave_r8(head.blocks)
    x = torch.randn(3, head.in_features)
    assert rel_err(head.kernel(x), bg.gemm(x, plain)) < 1e-6


def test_int8_from_a_float_checkpoint_runs_as_q8_0_blocks():
    """quantize="int8" on a float32 model with the block kernel: Q8_0 blocks (d = max|w| / 127 per 32
    values, float16), resident once, every row count on the kernel; without it PyTorch's int8 kernel."""
    w = torch.randn(70, 96, generator=torch.Generator().manual_seed(5)) * 0.05
    w[2, 32:64] = 0.0  # an all-zero block: d = 0, q = 0, exact
    b = quant.q8_0_from_float(w)
    assert b.q.dtype == torch.int8 and b.q.abs().max() <= 127 and torch.equal(b.d, b.d.half().float())
    deq = b.dequantize()
    assert torch.equal(deq[2, 32:64], w[2, 32:64])
    bound = (b.d / 2 + 1e-7).repeat_interleave(32, dim=1)
    assert ((deq - w).abs() <= bound).all()  # each value within half a step of its block's scale
    lin = quant.build_matrix([w], "int8", Backend.exact(torch.float32, torch.device("cpu"), "int8"))
    assert isinstance(lin, BlockLinear) and lin.kind == "q8_0_r8" and lin.dense is None
    assert torch.equal(lin.dequantize(), deq)
    for rows in (1, 5, 200):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        y = lin(x)
        assert y.dtype == torch.float32 and rel_err(y, bg.gemm_reference(x, lin.blocks)) < 1e-5
        assert rel_err(y, x.double() @ w.double().t()) < 0.02  # close to the float weights
    assert quant.build_matrix([w], "int8", Backend.exact(torch.bfloat16, torch.device("cpu"), "int8")).kind == "int8"
    with pytest.raises(Exception, match="divisible by 32"):
        quant.q8_0_from_float(torch.randn(4, 40))


def test_auto_dtype_is_float32_where_the_weights_run_on_the_block_kernel(smollm2_gguf):
    """dtype='auto' is a fixed rule of the CPU's features and the weights' format: the block kernel's
    float32 activations for GGUF blocks / int4 (dense copies bfloat16 where the CPU has it natively);
    otherwise forklm.device's rule (bfloat16 on native-bfloat16 CPUs)."""
    from forklm import LLM
    from forklm.device import resolve_dtype

    cpu = torch.device("cpu")
    def auto_dtype(quantize, has_blocks):
        return Backend.resolve(device="cpu", quantize=quantize, has_gguf_blocks=has_blocks).dtype

    assert auto_dtype("gguf", True) == auto_dtype("int4", False) == auto_dtype("auto", True) == torch.float32
    native = resolve_dtype("auto", cpu)
    assert auto_dtype("auto", False) == native  # a GGUF file of float tensors
    assert auto_dtype("int8", False) == torch.float32  # Q8_0 blocks on the kernel
    assert auto_dtype(None, True) == native
    llm = LLM("smollm2-135m", device="cpu")
    assert llm.dtype == torch.float32 and llm.quantize == "gguf"
    assert llm.model.layers[0]["qkv"].dense is None
    dense = LLM("smollm2-135m", device="cpu", quantize=None)  # no blocks: the device rule
    assert dense.dtype == resolve_dtype("auto", cpu)
    assert LLM("smollm2-135m", device="cpu", dtype="bfloat16").dtype == torch.bfloat16  # asked for: kept


def test_cpu_isa_avx2_takes_every_choice_an_avx2_cpu_would(monkeypatch):
    """FORKLM_CPU_ISA=avx2 hides the flags past AVX2 from forklm's rules (the kernel's AVX2 build,
    float32 dense copies, no native bfloat16); a value it does not know is refused by name."""
    import subprocess
    import sys

    from forklm.device import cpu_flags
    from forklm.errors import InvalidArgumentError

    probe = ("from forklm.device import cpu_flags, cpu_has_native_bf16; from forklm.kernels import block_gemm as bg;"
             "from forklm import backend; f = cpu_flags();"
             "print(any(x.startswith(('avx512', 'amx')) for x in f), 'avx2' in f, cpu_has_native_bf16(),"
             " bg.uses_vnni(), backend.block_dense_dtype(), backend.k_quants_interleaved())")
    env = {k: v for k, v in __import__("os").environ.items() if k != "FORKLM_CPU_ISA"}
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "FORKLM_CPU_ISA": "avx2"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True", "False", "False", "torch.float32", "True"]  # Q4_K / Q5_K interleaved on AVX2 too
    native = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.split()
    assert native[1] == "True" and native[0] == str(any(x.startswith(("avx512", "amx")) for x in cpu_flags()))
    assert native[5] == "True"  # Q4_K / Q5_K interleaved wherever the block kernel runs
    monkeypatch.setenv("FORKLM_CPU_ISA", "avx512")
    cpu_flags.cache_clear()
    try:
        with pytest.raises(InvalidArgumentError, match="FORKLM_CPU_ISA"):
            cpu_flags()
    finally:
        monkeypatch.delenv("FORKLM_CPU_ISA")
        cpu_flags.cache_clear()


@pytest.mark.parametrize("kind", KINDS)
def test_weight_rows_of_every_layout_are_those_rows(kind):
    """`rows` (an embedding lookup in a tied table held as blocks: a Q6_K token_embd is common) keeps
    every array of the layout, minima and K-quant scales regrouped: the rows' values exactly."""
    k = 512 if kind in K_KINDS else 576
    w = random_weights(kind, 37, k, seed=1)
    ids = torch.tensor([5, 0, 36, 17, 8, 9, 9])
    assert torch.equal(w.rows(ids).dequantize(), w.dequantize()[ids])
    assert torch.equal(w.dequantize_rows(ids), w.dequantize()[ids])  # the lookup's own path


@pytest.mark.parametrize("kind", bg.R8_KINDS)
def test_interleaved_row_lookup_in_cpp_equals_the_tensor_operations(kind):
    """The C++ lookup of interleaved rows (one call a decode step) gives the tensor operations' values
    bit for bit, for rows in any lane of any group, the last group padded; a bad id is refused."""
    k = 768 if kind in K_KINDS else 576
    w = random_weights(kind, 45, k, seed=4)  # 6 groups, the last with 5 live lanes
    ids = torch.randint(0, 45, (23,), generator=torch.Generator().manual_seed(3))
    ids[:3] = torch.tensor([44, 0, 7])
    want = bg.dequantize_values(*w._unpack_r8(bg.deinterleave_r8(w, ids)))

    def lookup(ids):  # (K layouts: d, m the super-blocks' ds, dm, then the blocks' sc, mq; Q6_K: its bits 4-5 as qh)
        if kind == "q6_k_r8":
            return bg._extension().dequantize_rows_r8(bg.R8_KINDS.index(kind), w.qs, w.q2, w.d, None, w.n, ids, w.sc, None)
        scales = (w.d, w.dm, w.n, ids, w.sc, w.m) if w.sc is not None else (w.d, w.m, w.n, ids)
        return bg._extension().dequantize_rows_r8(bg.R8_KINDS.index(kind), w.qs, w.qh, *scales)

    assert torch.equal(lookup(ids), want)
    with pytest.raises(IndexError, match="weight row 45 asked of 45"):
        lookup(torch.tensor([3, 45]))
    with pytest.raises(IndexError):
        w.dequantize_rows(torch.tensor([-1]))
    assert torch.equal(w.dequantize_rows(ids.int()), want)  # int32 ids
    assert w.dequantize_rows(torch.tensor([], dtype=torch.long)).shape == (0, k)
    for bad in (torch.tensor([1.5]), torch.tensor([True])):
        with pytest.raises(RuntimeError, match="integer tensor"):
            w.dequantize_rows(bad)



@pytest.mark.parametrize("interleave", [False, True])
def test_k_quant_tensors_take_the_layout_the_backend_picks(interleave):
    """GGUF Q4_K / Q5_K / Q6_K bytes (written by ggml itself) repack into the layout the backend picks
    (Q4_K / Q5_K interleaved on the VNNI build, plain on the AVX2 one; Q6_K interleaved on both) holding the
    file's values: both layouts' weights equal ggml's dequantization, their products the float product's to
    rounding (the interleaved layouts quantize the activations per 32, the plain ones per 256)."""
    from forklm.kernels import ggml_gemm

    if not ggml_gemm.available():
        pytest.fail(f"ggml's kernels did not build on an AVX2 CPU: {ggml_gemm.build_error()}")
    g = torch.Generator().manual_seed(7)
    for type_name, n in (("Q4_K", 37), ("Q5_K", 16), ("Q6_K", 21)):
        w = ggml_gemm.quantize(torch.randn(n, 512, generator=g), type_name)
        got = quant.stored_block_weights([w], interleave_k=interleave)
        plain = quant.stored_block_weights([w], interleave_k=False)
        want = {"Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k_r8"}[type_name]
        assert got.kind == (want + "_r8" if interleave and type_name != "Q6_K" else want)
        values = w.dequantize().float()
        assert torch.equal(got.dequantize(), values) and torch.equal(plain.dequantize(), values)
        x = torch.randn(5, 512, generator=g)
        assert rel_err(bg.gemm(x, got), x.double() @ values.double().t()) < 0.02
    assert Backend.exact(torch.float32, torch.device("cpu"), "gguf").interleaved_k_quants == backend.k_quants_interleaved()
