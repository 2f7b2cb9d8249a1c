"""ggml's CPU products on GGUF tensors kept as stored (forklm/kernels/ggml_gemm.py): every type's
dequantization against the gguf package's numpy dequantization (an independent reference), every
product against float64 math on those values, remainder shapes, and each row's result independent
of the rows around it."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from forklm.kernels import block_gemm, ggml_gemm

pytestmark = pytest.mark.skipif(not block_gemm.cpu_supports(), reason="ggml's kernels need x86-64 with AVX2")

# Byte offsets of each block's float16 scale fields (ggml-common.h's block structs), which random
# bytes must not fill with NaN / inf; the rest of a block is any bit pattern.
BLOCK_FP16_OFFSETS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}
QUANT_TYPES = list(BLOCK_FP16_OFFSETS)
FLOAT_TYPES = ["F32", "F16", "BF16"]
# ‖gemm − float64 reference‖ / ‖reference‖ allowed per activation type ggml converts to: 8-bit
# blocks (one scale per 32 or 256 values) vs float16 / bfloat16 roundings vs float32 itself.
TOLERANCE = {"q8_0": 2e-2, "q8_1": 2e-2, "q8_K": 2e-2, "f16": 2e-3, "bf16": 1e-2, "f32": 1e-5}


def _require_ggml():
    if not ggml_gemm.available():
        pytest.fail(f"ggml's kernels did not build on an AVX2 CPU: {ggml_gemm.build_error()}")


def random_rows(type_name: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, row_bytes]: n rows of k values of `type_name`, fresh random bits with sane scales."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in FLOAT_TYPES:
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        vals = torch.randn(n, k, generator=gen).to(dtype)
        return vals.view(torch.uint8).reshape(n, -1).contiguous()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nb = k // block
    raw = torch.randint(0, 256, (n, nb, size), generator=gen, dtype=torch.uint8)
    for off in BLOCK_FP16_OFFSETS[type_name]:
        scale = (torch.rand(n, nb, generator=gen) * 0.02 + 0.001).to(torch.float16)
        raw[:, :, off:off + 2] = scale.view(torch.uint8).view(n, nb, 2)
    return raw.reshape(n, nb * size).contiguous()


def gguf_dequantize(rows: torch.Tensor, type_name: str) -> torch.Tensor:
    import gguf

    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(rows.numpy(), gguf.GGMLQuantizationType[type_name]), dtype=np.float32))


def _k_for(type_name: str) -> list[int]:
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    act_block = 256 if type_name.endswith("_K") or type_name == "IQ4_XS" else 32
    step = max(block, act_block)
    return [step, 3 * step] if step == 256 else [step, 5 * step, 18 * step]


@pytest.mark.parametrize("type_name", QUANT_TYPES + FLOAT_TYPES)
def test_dequantize_matches_gguf_numpy(type_name):
    _require_ggml()
    gen = torch.Generator().manual_seed(zlib.crc32(type_name.encode()) % 1000)
    for k in _k_for(type_name):
        rows = random_rows(type_name, 19, k, gen)
        w = ggml_gemm.GGMLWeights(rows, type_name, 19, k)
        got = w.dequantize()
        want = gguf_dequantize(rows, type_name).reshape(19, k)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{type_name}, K={k}")
        ids = torch.tensor([5, 0, 18, 5])
        assert torch.equal(w.dequantize_rows(ids), want[ids])


@pytest.mark.parametrize("type_name", QUANT_TYPES + FLOAT_TYPES)
@pytest.mark.parametrize("T", [1, 3, 17, 70])  # activation tiles of 64: 70 has a remainder
def test_gemm_against_float64(type_name, T):
    _require_ggml()
    gen = torch.Generator().manual_seed(T * 31 + len(type_name))
    for k in _k_for(type_name)[:2]:
        n = 37  # not a multiple of the 16-row tasks
        rows = random_rows(type_name, n, k, gen)
        w = ggml_gemm.GGMLWeights(rows, type_name, n, k)
        x = torch.randn(T, k, generator=gen)
        y = ggml_gemm.gemm(x, w)
        ref = ggml_gemm.gemm_reference(x, w, gguf_dequantize(rows, type_name).reshape(n, k))
        err = float((y - ref).norm() / ref.norm())
        assert err < TOLERANCE[ggml_gemm.vec_dot_type(type_name)], f"{type_name} K={k} T={T}: {err:.2e}"


@pytest.mark.parametrize("type_name", ["Q4_0", "Q5_1", "Q4_K", "Q6_K", "F16"])
def test_rows_independent_of_batch_and_threads(type_name):
    """A row's result is the same bits alone, among 70 rows, and on 1 or 2 threads."""
    _require_ggml()
    gen = torch.Generator().manual_seed(7)
    k, n = _k_for(type_name)[1], 53
    w = ggml_gemm.GGMLWeights(random_rows(type_name, n, k, gen), type_name, n, k)
    x = torch.randn(70, k, generator=gen)
    full = ggml_gemm.gemm(x, w)
    for i in (0, 33, 69):
        assert torch.equal(ggml_gemm.gemm(x[i:i + 1], w)[0], full[i])
        assert torch.equal(ggml_gemm.gemm(x[i:i + 8], w)[0], full[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ggml_gemm.gemm(x, w), full)
    finally:
        torch.set_num_threads(threads)


def test_bad_shapes_are_clear_errors():
    _require_ggml()
    gen = torch.Generator().manual_seed(3)
    rows = random_rows("Q4_K", 4, 256, gen)
    w = ggml_gemm.GGMLWeights(rows, "Q4_K", 4, 256)
    with pytest.raises(RuntimeError, match="x must be float32"):
        ggml_gemm.gemm(torch.randn(2, 128), w)
    with pytest.raises(RuntimeError, match="divisible by 256"):
        ggml_gemm._extension().gemm(torch.randn(2, 128), rows[:, :72].contiguous(), w.type_id, 128)
    with pytest.raises(RuntimeError, match="bytes"):
        ggml_gemm._extension().gemm(torch.randn(2, 256), rows[:, :100].contiguous(), w.type_id, 256)


@pytest.mark.parametrize("types, k", [
    (types, k) for types in (["Q4_0"], ["Q4_1"], ["Q4_0", "Q4_0"], ["Q4_1", "Q4_0", "Q4_1"], ["Q5_0"], ["Q5_1"],
                             ["Q5_0", "Q5_0"], ["Q4_0", "Q5_0"],
                             ["Q4_0", "Q5_1", "Q4_1"], ["Q5_0", "Q5_0", "Q5_1"], ["Q8_0"],
                             ["IQ4_NL"], ["IQ4_NL", "IQ4_NL"])
    for k in (96, 576)  # an odd number of blocks (the last one alone) and the default model's
] + [(types, k) for types in (["Q4_K"], ["Q5_K"], ["Q4_K", "Q5_K", "Q4_K"], ["Q6_K"], ["Q6_K", "Q6_K"],
                               ["Q3_K"], ["Q3_K", "Q3_K"], ["Q2_K"], ["Q2_K", "Q2_K"], ["IQ4_XS"],
                               ["IQ4_XS", "IQ4_XS"])
       for k in (256, 1536)])
def test_block_kernel_repack_of_stored_bytes_matches_gguf_numpy(types, k):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / K-quant bytes repacked once for forklm's block kernel
    (quant.stored_block_weights: Q4_0 / Q5_0 as Q4_1 / Q5_1 blocks with minimum −8d / −16d; Q4_K /
    Q5_K values in Q4_1's order, their 6-bit scales a byte each, plain and interleaved; Q6_K interleaved; Q2_K / Q3_K's 2-bit fields and Q3_K's
    third-bit masks as stored, a scale per 16; IQ4_NL's and IQ4_XS's nibbles as stored, IQ4_XS's scales a
    byte per 32) hold the values gguf's numpy
    dequantization gives, bit for bit, fused parts of mixed types and a permuted row order included;
    the kernel's product is its slow reference's."""
    from forklm.models import quant

    gen = torch.Generator().manual_seed(zlib.crc32("".join(types).encode()) + k)
    parts, want = [], []
    for i, t in enumerate(types):
        n = 24 + 8 * i + 3
        rows = random_rows(t, n, k, gen)
        order = torch.randperm(n, generator=gen) if i == 0 else None  # HF row i stored at order[i]
        parts.append(ggml_gemm.GGMLWeights(rows, t, n, k, row_order=order))
        values = gguf_dequantize(rows, t)
        want.append(values if order is None else values[order])
    kind = quant.block_kernel_kind(types)
    if kind in ("q4_1", "q5_1"):  # run interleaved, Q4_0 / Q5_0 alone without minima
        alone = {"q4_1": "Q4_0", "q5_1": "Q5_0"}[kind]
        kind = kind[:3] + ("0_r8" if set(types) == {alone} else "1_r8")
    elif kind == "q6_k":  # interleaved on every build
        kind = "q6_k_r8"
    # Q4_K / Q5_K: interleaved where the backend's rule says (the VNNI build), else plain; both layouts here
    for interleave in ((None, False, True) if kind in ("q4_k", "q5_k") else (None,)):
        w = quant.stored_block_weights(parts, interleave_k=interleave)
        if interleave is None:
            from forklm.backend import k_quants_interleaved

            interleave = kind in ("q4_k", "q5_k") and k_quants_interleaved()
        assert w.kind == (kind + "_r8" if interleave else kind)
        assert torch.equal(w.dequantize(), torch.cat(want))
        x = torch.randn(5, k, generator=gen)
        ref = block_gemm.gemm_reference(x, w)
        assert ((block_gemm.gemm(x, w) - ref).norm() / ref.norm()) < 1e-5


def test_the_repack_refuses_a_row_order_outside_the_stored_rows():
    """The q / k row order is gathered inside the C++ pass: an entry outside the stored rows (or of
    the wrong type) is a clear error, never a read past the tensor."""
    gen = torch.Generator().manual_seed(9)
    rows = random_rows("Q4_1", 6, 64, gen)
    qs, d, m = torch.empty(6, 32, dtype=torch.uint8), torch.empty(6, 2, dtype=torch.float16), torch.empty(6, 2, dtype=torch.float16)
    order = torch.tensor([5, 4, 3, 2, 1, 0])
    block_gemm.repack_rows("Q4_1", rows, 0, qs, d, m, order=order)
    gathered = [torch.empty_like(t) for t in (qs, d, m)]
    block_gemm.repack_rows("Q4_1", rows[order].contiguous(), 0, *gathered)
    assert all(torch.equal(a, b) for a, b in zip((qs, d, m), gathered))  # the rows gathered in the pass
    with pytest.raises(RuntimeError, match="outside the 6 stored rows"):
        block_gemm.repack_rows("Q4_1", rows, 0, qs, d, m, order=torch.tensor([0, 1, 6]))
    with pytest.raises(RuntimeError, match="outside"):
        block_gemm.repack_rows("Q4_1", rows, 0, qs, d, m, order=torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="int64"):
        block_gemm.repack_rows("Q4_1", rows, 0, qs, d, m, order=torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("type_name,factor", [("Q4_0", -8), ("Q5_0", -16)])
def test_a_minimum_that_overflows_float16_is_refused(type_name, factor):
    """Q4_0 / Q5_0 beside Q4_1 / Q5_1 run as Q4_1 / Q5_1 with minimum factor·d in float16: a block whose
    d is too large for that is refused with the count and the rule, never written as an infinity.
    Alone they keep no minima (factor·d is applied in integers): the same block loads, exactly."""
    from forklm.models import quant

    gen = torch.Generator().manual_seed(3)
    rows = random_rows(type_name, 9, 64, gen)
    huge = torch.tensor([60000.0], dtype=torch.float16).view(torch.uint8)
    rows[4, 0:2] = huge  # row 4, block 0: d = 60000, so factor·d overflows
    parts = [ggml_gemm.GGMLWeights(rows, type_name, 9, 64)]
    w = quant.stored_block_weights(parts)  # alone: no minima kept, so nothing to overflow
    assert w.kind == type_name.lower() + "_r8" and torch.equal(w.dequantize(), gguf_dequantize(rows, type_name))
    partner = {"Q4_0": "Q4_1", "Q5_0": "Q5_1"}[type_name]
    parts.append(ggml_gemm.GGMLWeights(random_rows(partner, 8, 64, gen), partner, 8, 64))
    with pytest.raises(ValueError, match=rf"1 {type_name} blocks' minimum {factor}d overflows float16"):
        quant.stored_block_weights(parts)


def test_row_range_is_a_view_of_those_rows():
    """`GGMLWeights.row_range` (one expert of a stacked [E, rows, k] tensor): the stored rows a..b as a
    weight of their own, no copy, their values those rows' values; a permuted weight refuses it."""
    gen = torch.Generator().manual_seed(11)
    rows = random_rows("Q4_K", 24, 256, gen)
    w = ggml_gemm.GGMLWeights(rows, "Q4_K", 24, 256)
    part = w.row_range(8, 16)
    assert part.shape == (8, 256) and part.data.data_ptr() == rows[8].data_ptr()
    assert torch.equal(part.dequantize(), w.dequantize()[8:16])
    with pytest.raises(ValueError, match="permuted"):
        ggml_gemm.GGMLWeights(rows, "Q4_K", 24, 256, row_order=torch.randperm(24, generator=gen)).row_range(0, 8)


def test_a_relative_ggml_dir_is_made_absolute(monkeypatch, tmp_path):
    """FORKLM_GGML_DIR relative to the working directory names the same folder once the linker runs
    in the build's own folder (a relative -L there found nothing, and the failed build was recorded)."""
    from forklm.kernels import ggml_gemm

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FORKLM_GGML_DIR", "some/ggml")
    assert ggml_gemm.ggml_dir() == tmp_path / "some" / "ggml"
    assert ggml_gemm.ggml_dir().is_absolute()
