"""forklm's C++ sampler (kernels/cpu_sampler.py) against the rule written the slow, obvious way
(`sample_weights_reference`: a stable sort, float64 cumulative sums), token for token."""

import os
import subprocess
import sys
import zlib

import pytest
import torch
from conftest import native_kernels_expected

from forklm.kernels import cpu_sampler
from forklm.sampling.sampler import (
    model_logprobs,
    sample_tokens,
    sample_tokens_reference,
    sample_tokens_torch,
    sample_weights_reference,
)

# skipped only where the kernels cannot run (the CPU, torch's OpenMP); on a CPU that should build
# the C++ sampler, a failed build fails `test_builds_here` (and the rest) instead of passing silently
pytestmark = pytest.mark.skipif(not native_kernels_expected(), reason="no AVX2 / FMA / F16C, or torch without libgomp")


def test_builds_here():
    assert cpu_sampler.build_error() is None

CASES = ["flat", "peaked", "ties", "spiky", "zeros", "near-uniform"]


def case_logits(case: str, rows: int, V: int, gen: torch.Generator) -> torch.Tensor:
    scale = {"flat": 0.3, "peaked": 4.0, "ties": 1.0, "spiky": 1.0, "zeros": 2.0, "near-uniform": 0.001}[case]
    logits = torch.randn(rows, V, generator=gen) * scale
    if case == "ties":  # many exactly equal weights, boundaries inside a tie
        logits = torch.round(logits * 2) / 2
    if case == "spiky":  # a few huge, the rest tiny
        logits[:, :5] += 12
    if case == "zeros":  # masked tokens (weight exactly 0) and weights that underflow
        logits[:, ::3] = float("-inf")
        logits[:, 1::7] -= 95
    return logits


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("V", [50, 7001, 49152])
def test_draws_follow_the_reference_rule_token_for_token(case, V):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case} {V}".encode()))
    logits = case_logits(case, 24, V, gen)
    settings = [(1.0, 0, 1.0), (0.8, 0, 0.9), (0.8, 0, 0.95), (1.0, 40, 1.0), (0.7, 40, 0.5), (1.0, 1, 0.9),
                (1.0, 0, 0.001), (1.2, V - 1, 0.999), (1.0, V + 5, 0.3), (0.05, 0, 0.95), (2.0, 3, 1.0)]
    for temperature, top_k, top_p in settings:
        u = torch.rand(24, generator=gen, dtype=torch.float64)
        u[0], u[1] = 0.0, 1.0 - 2.0**-53  # the ends of the uniforms' range
        got = cpu_sampler.sample_logits(logits, temperature, top_k, top_p, u)
        weights = cpu_sampler.sample_weights(logits, temperature)
        want = sample_weights_reference(weights, top_k, top_p, u)
        assert torch.equal(got, want), (temperature, top_k, top_p, (got != want).nonzero().flatten().tolist())
        # and with PyTorch's softmax in place of the kernel's weights: the same away from the ends (at
        # u = 0 a weight below float32's normals, 0 here and denormal in PyTorch, is the first drawn)
        # where weights differ by more than their last bits (near-uniform rows: one ulp reorders them)
        if case != "near-uniform":
            assert torch.equal(got[2:], sample_tokens_reference(logits[2:], temperature, top_k, top_p, u[2:]))
        assert torch.equal(sample_tokens(logits, temperature, top_k, top_p, u), got)  # the dispatch takes the kernel


def test_weights_are_the_softmax_numerators():
    gen = torch.Generator().manual_seed(3)
    for temperature in (1.0, 0.7, 0.05, 3.0):
        logits = torch.randn(8, 49152, generator=gen) * 4
        logits[:, ::11] = float("-inf")
        w = cpu_sampler.sample_weights(logits, temperature).double()
        ref = torch.softmax(logits.double() / temperature, dim=-1)
        assert bool((w.amax(-1) == 1.0).all())  # exp(0) exactly: the row's largest logit
        got = w / w.sum(-1, keepdim=True)
        big = ref > 1e-30
        rel = ((got - ref).abs() / ref)[big]
        # float32 rounding of l / T (|l / T| up to ~300 here) and of the exp: torch's own softmax errs as much
        assert float(rel.max()) < 1e-4, float(rel.max())
        assert bool((got[logits.isneginf()] == 0).all())


def test_token_logprobs_are_the_models_log_softmax():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 49152, generator=gen) * 5
    logits[3, 7] = float("-inf")
    tokens = torch.randint(0, 49152, (16,), generator=gen)
    tokens[3] = 7
    got = cpu_sampler.token_logprobs(logits, tokens).double()
    want = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None])[:, 0]
    assert got[3] == float("-inf")
    keep = torch.arange(16) != 3
    assert float((got[keep] - want[keep]).abs().max()) < 1e-5
    assert torch.equal(model_logprobs(logits, tokens), got.float())  # the dispatch takes the kernel


def test_a_rows_token_does_not_depend_on_the_batch():
    """Rows alone and inside a batch of 64 (split across threads) draw the same tokens."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.cat([case_logits(c, 11, 49152, gen) for c in CASES])[:64]
    u = torch.rand(logits.shape[0], generator=gen, dtype=torch.float64)
    for top_k, top_p in [(0, 0.95), (50, 0.9), (0, 1.0)]:
        batched = cpu_sampler.sample_logits(logits, 0.8, top_k, top_p, u)
        for r in range(0, logits.shape[0], 7):
            assert cpu_sampler.sample_logits(logits[r : r + 1], 0.8, top_k, top_p, u[r : r + 1])[0] == batched[r]


def test_broken_rows_draw_token_0_and_report_nan():
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(1))
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[2, 10] = float("nan")
    logits[3, 20] = float("inf")
    u = torch.rand(5, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for top_k, top_p in [(0, 0.9), (40, 0.9), (0, 1.0)]:
        toks = cpu_sampler.sample_logits(logits, 1.0, top_k, top_p, u)
        assert toks[:4].tolist() == [0, 0, 0, 0] and 0 <= int(toks[4]) < 3000
    lps = cpu_sampler.token_logprobs(logits, torch.full((5,), 4))
    assert bool(lps[:4].isnan().all()) and bool(lps[4].isfinite())


def test_bad_input_gets_a_clear_error():
    logits = torch.randn(2, 100)
    u = torch.rand(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32 CPU matrix"):
        cpu_sampler.sample_logits(logits.double(), 1.0, 0, 0.9, u)
    with pytest.raises(RuntimeError, match="uniforms must be float64"):
        cpu_sampler.sample_logits(logits, 1.0, 0, 0.9, u.float())
    with pytest.raises(RuntimeError, match="top_p"):
        cpu_sampler.sample_logits(logits, 1.0, 0, 1.5, u)
    with pytest.raises(RuntimeError, match="temperature"):
        cpu_sampler.sample_logits(logits, 0.0, 0, 0.9, u)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        cpu_sampler.token_logprobs(logits, torch.tensor([0, 100]))
    assert cpu_sampler.sample_logits(logits[:0], 1.0, 0, 0.9, u[:0]).shape == (0,)


def test_the_pytorch_path_follows_the_same_rule_up_to_rounding():
    """Where the kernel is not built (or on a GPU) `sample_tokens_torch` draws: the same tokens,
    except where equal weights are ordered otherwise (topk breaks ties its own way) or a float32 sum
    rounds across the nucleus boundary."""
    gen = torch.Generator().manual_seed(11)
    total = differ = 0
    for case in ["flat", "peaked", "spiky", "zeros"]:
        logits = case_logits(case, 32, 7001, gen)
        for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.8, 0, 0.95), (0.7, 40, 0.5), (1.0, 0, 0.001), (1.0, 20, 1.0)]:
            u = torch.rand(32, generator=gen, dtype=torch.float64)
            got = sample_tokens_torch(logits, temperature, top_k, top_p, u)
            differ += int((got != cpu_sampler.sample_logits(logits, temperature, top_k, top_p, u)).sum())
            total += 32
    assert differ <= total // 200, (differ, total)


def test_the_environment_switch_turns_the_kernel_off():
    code = "from forklm.kernels import cpu_sampler; print(cpu_sampler.available(), cpu_sampler.build_error())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FORKLM_CPU_SAMPLER": "0"},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False disabled by FORKLM_CPU_SAMPLER=0"
