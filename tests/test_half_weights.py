"""bfloat16 / float16 weights as stored on the block kernel (`gemm_bf16` / `gemm_f16`): float32
products of the widened values, each row's result that row's alone."""

from __future__ import annotations

import contextlib

import pytest
import torch

from forklm.kernels import block_gemm as bg

pytestmark = pytest.mark.skipif(not bg.cpu_supports(), reason="the block kernel needs x86-64 with AVX2, FMA, F16C")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@contextlib.contextmanager
def vector_chains(*modules):
    """The vector chains for bfloat16 too: the AMX tiles (integer and AMX-BF16) off in these modules."""
    modules = modules or (bg._extension(),)
    try:
        for m in modules:
            m.set_amx(False)
        yield
    finally:
        for m in modules:
            m.set_amx(True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,N,K", [(1, 8, 32), (1, 77, 96), (3, 19, 64), (5, 130, 576), (17, 64, 160), (64, 9, 32)])
def test_half_product_matches_float64_and_dense_rows(dtype, T, N, K):
    """Every remainder of outputs (8 / 4 / 2 at a time and the rest) and rows (4 / 2 / 1): close to
    the float64 product of the stored values, and bit for bit `dense_rows` on the widened weights
    (the same per-output order)."""
    torch.manual_seed(T * 1000 + N + K)
    w = (torch.randn(N, K) * 0.5).to(dtype)
    x = torch.randn(T, K)
    wb = bg.pack_half(w)
    y = bg.gemm(x, wb)  # (bfloat16 on AMX-BF16 tiles where the CPU has them)
    assert y.shape == (T, N) and y.dtype == torch.float32
    assert rel_err(y, bg.gemm_reference(x, wb)) < 1e-6
    with vector_chains():
        yv = bg.gemm(x, wb)
    assert rel_err(yv, bg.gemm_reference(x, wb)) < 1e-6
    assert torch.equal(yv, bg.dense_rows(x.unsqueeze(1), w.float().unsqueeze(0)).squeeze(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_fusions_match_the_reference(dtype):
    torch.manual_seed(3)
    T, N, K = 7, 45, 128
    w = torch.randn(N, K).to(dtype)
    wb = bg.pack_half(w)
    x, g = torch.randn(T, K) * 3, torch.rand(K) + 0.5
    res = torch.randn(T, N)
    y = bg.gemm(x, wb, norm_weight=g, eps=1e-5, residual=res)
    ref = bg.gemm_reference(x, wb, norm_weight=g, eps=1e-5, residual=res)
    assert rel_err(y, ref) < 1e-6
    xu = torch.randn(T, 2 * K)
    assert rel_err(bg.gemm(xu, wb, swiglu=True), bg.gemm_reference(xu, wb, swiglu=True)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_rows_half_product_does_not_depend_on_the_rows_beside_it(dtype):
    """Row 0's outputs are the same bits alone and among 1..40 other rows, with and without fusions."""
    torch.manual_seed(5)
    N, K = 83, 192
    w = torch.randn(N, K).to(dtype)
    wb = bg.pack_half(w)
    x = torch.randn(41, K)
    g = torch.rand(K) + 0.5
    alone = bg.gemm(x[:1], wb, norm_weight=g, eps=1e-6)
    for t in (2, 3, 4, 5, 8, 9, 24, 41):
        assert torch.equal(bg.gemm(x[:t], wb, norm_weight=g, eps=1e-6)[:1], alone), t
        assert torch.equal(bg.gemm(x[:t], wb)[:1], bg.gemm(x[:1], wb)), t


@pytest.mark.skipif(not bg.uses_vnni(), reason="this CPU has no AVX512-VNNI: the kernel runs its AVX2 build")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_vnni_build_equals_the_avx2_build_bit_for_bit(dtype):
    """The VNNI build's 512-bit chains are the AVX2 build's pairs of 256-bit ones (16 lanes over k, the
    two halves summed, then `hsum`): the same bits at every tile of rows (1-9), plain and fused, and
    `dense_rows` too, with a tail past the last 16 values of K."""
    avx2 = bg.load_cpu_extension("forklm_block_gemm", bg._SOURCE)
    vnni = bg._extension()
    assert avx2 is not vnni and "vnni" in vnni.__name__  # the VNNI build, not a silent fallback
    torch.manual_seed(12)
    N, K = 71, 224
    w = torch.randn(N, K).to(dtype)
    fn = {torch.bfloat16: "gemm_bf16", torch.float16: "gemm_f16"}[dtype]
    g, eps = torch.rand(K) + 0.5, 1e-5
    for t in (1, 2, 3, 4, 5, 9):
        x, res = torch.randn(t, K) * 3, torch.randn(t, N)
        for mode, nw, r in ((bg.PLAIN, None, None), (bg.RMS_NORM, g, res)):
            a = getattr(avx2, fn)(x, w, mode, nw, eps, r)
            with vector_chains(vnni):  # (the AMX-BF16 tiles sum in another order)
                assert torch.equal(a, getattr(vnni, fn)(x, w, mode, nw, eps, r)), (t, mode)
        for k in (K, 40, 7):  # 16-lane chains and a tail of 8; a tail alone
            xd, wd = torch.randn(t, 2, k), torch.randn(2, 13, k)
            assert torch.equal(avx2.dense_rows(xd, wd), vnni.dense_rows(xd, wd)), (t, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gathered_half_parts_equal_their_copy_bit_for_bit(dtype):
    """Parts read where they lie through a table of row addresses (a fused q/k/v on the mapped file,
    rows reordered, a part a strided slice of a bigger matrix): the same bits as the gathered copy at
    every tile of rows, plain and fused, and the table's lookups and values are the parts' rows."""
    torch.manual_seed(21)
    K = 160
    big = torch.randn(40, K).to(dtype)
    q, kk, v = (torch.randn(n, K).to(dtype) for n in (24, 9, 9))
    part_b = big[10:19]  # a contiguous slice: its rows start past the matrix's first
    order_q = torch.randperm(24)
    wg = bg.gather_half([(q, order_q), (part_b, None), (kk, torch.arange(9).flip(0)), (v, None)])
    copy = torch.cat([q[order_q], part_b, kk.flip(0), v])
    assert wg.n == copy.shape[0] and wg.k == K and wg.qs.dtype == torch.int64
    assert torch.equal(wg.values(), copy)
    wc = bg.pack_half(copy)
    g, eps = torch.rand(K) + 0.5, 1e-5
    for t in (1, 2, 3, 4, 5, 9, 33):
        x, res = torch.randn(t, K) * 2, torch.randn(t, copy.shape[0])
        assert torch.equal(bg.gemm(x, wg), bg.gemm(x, wc)), t
        assert torch.equal(bg.gemm(x, wg, norm_weight=g, eps=eps, residual=res),
                           bg.gemm(x, wc, norm_weight=g, eps=eps, residual=res)), t
    xu = torch.randn(3, 2 * K)
    assert torch.equal(bg.gemm(xu, wg, swiglu=True), bg.gemm(xu, wc, swiglu=True))
    assert rel_err(bg.gemm(x, wg), bg.gemm_reference(x, wg)) < 1e-6
    ids = torch.tensor([0, 41, 30, 24, 5])
    assert torch.equal(wg.dequantize_rows(ids), copy.float()[ids])
    assert torch.equal(wg.rows(ids).dequantize(), copy.float()[ids])
    assert wg.num_bytes() >= copy.numel() * 2  # the parts it holds are counted


def test_bad_gathered_parts_are_refused_with_a_message():
    a = torch.randn(4, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype and width"):
        bg.gather_half([(a, None), (torch.randn(4, 32).to(torch.float16), None)])
    with pytest.raises(ValueError, match="one dtype and width"):
        bg.gather_half([(a, None), (torch.randn(4, 64).to(torch.bfloat16), None)])
    with pytest.raises(ValueError, match="one dtype and width"):
        bg.gather_half([(torch.randn(32, 8).to(torch.bfloat16).t(), None)])  # not contiguous
    with pytest.raises(ValueError, match="row order"):
        bg.gather_half([(a, torch.tensor([0, 1, 2, 4]))])
    with pytest.raises(ValueError, match="no parts"):
        bg.gather_half([])


def test_half_rows_and_lookups_are_the_stored_values():
    torch.manual_seed(1)
    w = torch.randn(50, 64).to(torch.bfloat16)
    wb = bg.pack_half(w)
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.equal(wb.dequantize_rows(ids), w.float()[ids])
    assert torch.equal(wb.rows(ids).dequantize(), w.float()[ids])
    assert torch.equal(wb.dequantize(), w.float())
    with pytest.raises(IndexError):
        wb.dequantize_rows(torch.tensor([50]))


def test_bad_half_weights_are_refused_with_a_message():
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        bg.pack_half(torch.randn(4, 32))
    with pytest.raises(ValueError, match="divisible by 32"):
        bg.pack_half(torch.randn(4, 40).to(torch.bfloat16))
    wb = bg.pack_half(torch.randn(4, 32).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="K must be a multiple of 32|weights must be"):
        bg.gemm(torch.randn(2, 64), wb)
    with pytest.raises(RuntimeError, match="bfloat16 weights must be"):
        bg._extension().gemm_bf16(torch.randn(2, 32), torch.randn(4, 32), 0, None, 0.0, None)


def _half_folder(path, variant: str, dtype: torch.dtype):
    """A random checkpoint saved by transformers in `dtype`, with a word-level tokenizer; returns the
    transformers model in float32 on the same (16-bit) values."""
    from test_models_hf import save_random
    from tokenizers import Tokenizer as TokBackend
    from tokenizers import models, pre_tokenizers

    hf = save_random(path / "f32", variant)
    hf = hf.to(dtype)
    hf.save_pretrained(path)
    tok = TokBackend(models.WordLevel(vocab={f"w{i}": i for i in range(320)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return hf.float()


@pytest.mark.parametrize("variant, dtype", [("llama-gqa", torch.bfloat16), ("qwen2", torch.float16),
                                            ("llama-mha", torch.bfloat16)])  # tied; q/k/v biases; untied head
def test_a_half_folder_runs_its_matrices_as_stored_exactly(tmp_path, variant, dtype):
    """LLM(folder) on a bfloat16 / float16 checkpoint keeps every matrix as stored on the block kernel's
    tiles (no dense copy, the decode stack on) and computes in float32: transformers in float32 on the
    same values, to float rounding; quantize=None still loads it dense."""
    from test_quant import model_logits

    from forklm import LLM
    from forklm.kernels import decode_stack
    from forklm.models.quant import BlockLinear

    hf = _half_folder(tmp_path, variant, dtype)
    llm = LLM(str(tmp_path))
    m = llm.model
    assert llm.quantize == "gguf" and m.dtype == torch.float32
    kind = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    for layer in m.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            assert isinstance(layer[name], BlockLinear) and layer[name].kind == kind and layer[name].dense is None
    assert isinstance(m.lm_head, BlockLinear) and m.lm_head.kind == kind and m.embed is None
    assert decode_stack.unsupported_reason(m) is None
    n_matrix = sum(p.numel() for name, p in hf.named_parameters() if p.dim() == 2)
    assert m.num_weight_bytes() < 2 * n_matrix * 1.05 + 100_000  # 16 bits a value, resident once
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))
    prefill, steps = model_logits(m, ids[:34], ids[34:])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert rel_err(prefill, ref[:34]) < 1e-5 and rel_err(steps, ref[34:]) < 1e-5
    # seeded samples: sample i the same bits whatever n
    kw = dict(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True)
    one = llm.sample("w1 w2 w3 w4", n=1, **kw).samples[0]
    many = llm.sample("w1 w2 w3 w4", n=8, **kw).samples[0]
    assert one.token_ids == many.token_ids and one.logprobs == many.logprobs
    dense = LLM(str(tmp_path), quantize=None)
    assert dense.quantize is None and not isinstance(dense.model.layers[0]["qkv"], BlockLinear)


def test_the_half_kernels_bench_times_checked_products():
    from bench.half_kernels import measure

    (row,) = measure([(40, 64)], [3], torch.bfloat16)
    assert row["rows"] == 3 and row["forklm_rel_err"] < 1e-6
    assert min(row["forklm_ms"], row["torch_16bit_ms"], row["torch_float32_ms"]) > 0


@pytest.mark.skipif(not bg.uses_amx_bf16(), reason="no AMX-BF16 here (or FORKLM_BLOCK_KERNEL_AMX=0)")
@pytest.mark.parametrize("T,N,K", [(1, 8, 32), (1, 77, 96), (7, 130, 576), (16, 64, 160), (17, 33, 2048),
                                   (33, 100, 256), (40, 16, 64), (64, 9, 32), (33, 40, 4160), (5, 24, 8192)])
def test_amx_bf16_tiles_are_float32_class_and_each_rows_own(T, N, K):
    """bfloat16 weights on AMX-BF16 tiles (activations split exactly into three bfloat16 parts): every
    output within float32 rounding of the float64 product of the stored values (|error| a few 2^-24
    of Σ|x·w|), plain, fused (RMSNorm, residual) and through a table of unevenly spaced rows; a row's
    bits the same alone and among 1..T-1 other rows (blocks of 16 rows and a tail, 16 outputs and a tail,
    K past 2,048 in slices)."""
    torch.manual_seed(T * 7919 + N * 31 + K)
    w = (torch.randn(N, K) * 0.3).to(torch.bfloat16)
    x = torch.randn(T, K) * 2
    x[0, :5] = torch.tensor([1e-30, -3e-38, 6e4, 1.0 + 2**-20, -(2**-17)])  # tiny, large, past bfloat16's bits
    wb = bg.pack_half(w)
    y = bg.gemm(x, wb)
    ref = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * (K * 2**-24) + 1e-35
    assert ((y.double() - ref).abs() <= bound).all()
    assert rel_err(y, ref) < 1e-6
    with vector_chains():
        yv = bg.gemm(x, wb)
    assert rel_err(yv, ref) < 1e-6 and not torch.equal(y, yv) or T * N < 64  # AMX ran: other last bits
    for t in sorted({1, 2, 15, 16, 17, 31, 32, T - 1} & set(range(1, T))):
        assert torch.equal(bg.gemm(x[:t], wb), y[:t]), t
    g, eps, res = torch.rand(K) + 0.5, 1e-5, torch.randn(T, N)
    fused = bg.gemm(x, wb, norm_weight=g, eps=eps, residual=res)
    assert rel_err(fused, bg.gemm_reference(x, wb, norm_weight=g, eps=eps, residual=res)) < 1e-6
    assert torch.equal(bg.gemm(x[:1], wb, norm_weight=g, eps=eps, residual=res[:1]), fused[:1])
    order = torch.randperm(N)  # rows through a table: reordered (copied per block) and as stored
    wg = bg.gather_half([(w, order)])
    assert torch.equal(bg.gemm(x, wg), bg.gemm(x, bg.pack_half(w[order].contiguous())))
    assert torch.equal(bg.gemm(x, bg.gather_half([(w[: N // 2], None), (w[N // 2 :], None)])), y)


@pytest.mark.skipif(not bg.uses_amx_bf16(), reason="no AMX-BF16 here (or FORKLM_BLOCK_KERNEL_AMX=0)")
def test_amx_bf16_tiles_keep_nan_and_overflow_visible():
    """A NaN activation gives NaN outputs on the tiles as on the chains; float32 overflow gives inf, not a
    silent finite value."""
    torch.manual_seed(4)
    w = (torch.rand(20, 64) + 0.5).to(torch.bfloat16)  # positive: row 2's sums pass float32's largest
    x = torch.randn(3, 64)
    x[1, 7] = float("nan")
    x[2, :] = 3e38
    wb = bg.pack_half(w)
    y = bg.gemm(x, wb)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()
    assert not torch.isfinite(y[2]).any()
