"""`forklm serve` in a child process on a free loopback port, for tests and benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time


class ServerProcess:
    def __init__(self, *args: str, model: str = "smollm2-135m", api_key: str | None = None,
                 timeout: float = 180.0) -> None:
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="forklm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "forklm", "serve", "--model", model, "--port", str(self.port),
               "--log-level", "warning", *args]
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
        """An `openai.OpenAI` client of this server (no retries: tests see every error)."""
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
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
