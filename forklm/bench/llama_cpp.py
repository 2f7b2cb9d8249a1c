"""llama.cpp as a peer in `forklm bench --llama-cpp`: its `llama-batched-bench` at forklm's points.

The binary is built by scripts/build_llama_cpp.sh from the sources vendored in the pinned
llama-cpp-python sdist (or named by $FORKLM_LLAMA_CPP_BIN). One invocation per context length
m_c and flash-attention setting runs every n of the sweep:

    llama-batched-bench -m MODEL.gguf -npp m_c -ntg new_tokens -npl n1,n2,... -pps -kvu
        -fa off|on -t T -tb T -c m_c+max(n)*new_tokens --output-format jsonl

-pps: the prompt is prefilled once and shared by the n sequences; -kvu: one unified KV buffer (the
shared prompt is stored once). It decodes the same GGUF file as stored (quantized), with
random prompt tokens and no sampling (the next tokens are random too, logits computed for every
row). Its decode loop is timed as a whole, so `step_ms_median` of its rows is decode_s /
new_tokens (a mean), and tokens_per_s = n * new_tokens / decode_s, generated tokens per second as
in forklm's rows.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ENV_VAR = "FORKLM_LLAMA_CPP_BIN"
BUILD_SCRIPT = "scripts/build_llama_cpp.sh"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist the build script pins
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BINARY = REPO_ROOT / ".cache" / "llama.cpp" / f"build-{LLAMA_CPP_PYTHON_VERSION}" / "bin" / "llama-batched-bench"
IMPL = {False: "llama.cpp", True: "llama.cpp-fa"}  # flash attention off / on


class LlamaCppNotFound(FileNotFoundError):
    """The llama-batched-bench binary is not where $FORKLM_LLAMA_CPP_BIN or the default build puts it."""


def find_binary(environ: dict[str, str] | None = None) -> Path:
    """$FORKLM_LLAMA_CPP_BIN if set, else the build script's output; LlamaCppNotFound when absent."""
    environ = os.environ if environ is None else environ
    named = environ.get(ENV_VAR)
    path = Path(named) if named else DEFAULT_BINARY
    if not (path.is_file() and os.access(path, os.X_OK)):
        where = f"${ENV_VAR}={named}" if named else str(path)
        raise LlamaCppNotFound(
            f"--llama-cpp: no llama-batched-bench executable at {where}; build it with `{BUILD_SCRIPT}` "
            f"(10+ minutes on 2 cores) or set ${ENV_VAR} to one")
    return path


def context_size(m_c: int, ns: list[int], new_tokens: int) -> int:
    """KV cells one invocation needs: the shared prompt once (unified KV) + every sequence's tokens."""
    return m_c + max(ns) * new_tokens


def batched_bench_command(binary: Path, gguf: Path, m_c: int, ns: list[int], new_tokens: int, threads: int,
                          flash_attn: bool) -> list[str]:
    """The argument list of one invocation: every n at one m_c, one flash-attention setting."""
    return [str(binary), "-m", str(gguf),
            "-npp", str(m_c), "-ntg", str(new_tokens), "-npl", ",".join(str(n) for n in ns),
            "-pps", "-kvu", "-fa", "on" if flash_attn else "off",
            "-t", str(threads), "-tb", str(threads),
            "-c", str(context_size(m_c, ns, new_tokens)), "-b", "2048", "-ub", "512",
            "--output-format", "jsonl"]


def parse_jsonl(text: str) -> list[dict]:
    """The result lines of `--output-format jsonl` (one JSON object per (pp, tg, pl)); log lines are skipped."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            rows.append(json.loads(line))
    return rows


def to_point(raw: dict, command: str) -> dict:
    """One llama-batched-bench result in forklm's row format (same field names where they mean the same)."""
    n, new_tokens = raw["pl"], raw["tg"]
    flash_attn = raw["flash_attn"] == 1  # llama_flash_attn_type: -1 auto, 0 disabled, 1 enabled
    return {
        "m_c": raw["pp"], "n": n, "impl": IMPL[flash_attn],
        "prefill_s": raw["t_pp"],
        "decode_s": raw["t_tg"],
        "e2e_s": raw["t"],
        "step_ms_median": raw["t_tg"] / new_tokens * 1e3,  # a mean: the decode loop is timed as a whole
        "tokens_per_s": n * new_tokens / raw["t_tg"] if raw["t_tg"] > 0 else None,
        "prefill_tokens_per_s": raw["speed_pp"],
        "peak_mem_mib": None, "floor_ms": None, "floor_naive_ms": None, "floor_fraction": None,
        "auto_paths": None,
        "steps": new_tokens,
        "flash_attn": flash_attn,
        "n_kv": raw["n_kv"], "n_ctx": raw["n_kv_max"], "n_batch": raw["n_batch"], "n_ubatch": raw["n_ubatch"],
        "threads": raw["n_threads"], "threads_batch": raw["n_threads_batch"],
        "command": command,
    }


def skipped_point(m_c: int, n: int, flash_attn: bool, reason: str, command: str) -> dict:
    return {"m_c": m_c, "n": n, "impl": IMPL[flash_attn], "prefill_s": None, "decode_s": None, "e2e_s": None,
            "step_ms_median": None, "tokens_per_s": None, "peak_mem_mib": None, "floor_ms": None,
            "floor_naive_ms": None, "floor_fraction": None, "auto_paths": None, "flash_attn": flash_attn,
            "skipped": reason, "command": command}


def binary_version(binary: Path) -> str:
    """`llama-batched-bench --version`, e.g. 'version: 0 (0c1e57098); built with GNU 12.2.0 for Linux x86_64'."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__}: {e})"
    lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    return "; ".join(ln for ln in lines if ln.startswith(("version", "built with"))) or "unknown"


class LlamaCppPeer:
    """Runs llama-batched-bench on one GGUF file with a fixed thread count; returns forklm-style rows."""

    def __init__(self, binary: Path, gguf: Path, threads: int) -> None:
        self.binary, self.gguf, self.threads = Path(binary), Path(gguf), int(threads)

    def run(self, m_c: int, ns: list[int], new_tokens: int, flash_attn: bool) -> list[dict]:
        """One invocation: a row per n, in the order of ns. A failed run or a missing result becomes a skipped row."""
        args = batched_bench_command(self.binary, self.gguf, m_c, ns, new_tokens, self.threads, flash_attn)
        command = " ".join(args)
        done = subprocess.run(args, capture_output=True, text=True)
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            return [skipped_point(m_c, n, flash_attn, f"llama-batched-bench exited {done.returncode}: {tail}", command)
                    for n in ns]
        by_n = {raw["pl"]: to_point(raw, command) for raw in parse_jsonl(done.stdout)}
        return [by_n.get(n) or skipped_point(m_c, n, flash_attn, "no result line from llama-batched-bench", command)
                for n in ns]

    def run_context(self, m_c: int, ns: list[int], new_tokens: int, repeats: int = 1,
                    progress: Any = None) -> list[dict]:
        """Both flash-attention settings at one m_c, `repeats` times interleaved (off, on, off, on, ...);
        per point the run with the fastest decode counts (the others' steps kept as step_ms_repeats)."""
        runs: dict[bool, list[list[dict]]] = {False: [], True: []}
        for _ in range(repeats):
            for flash_attn in (False, True):
                if progress is not None:
                    progress.set_description(f"m_c={m_c} n={','.join(map(str, ns))} {IMPL[flash_attn]}")
                runs[flash_attn].append(self.run(m_c, ns, new_tokens, flash_attn))
                if progress is not None:
                    progress.update(1)
        rows = []
        for i in range(len(ns)):
            for flash_attn in (False, True):
                tries = [r[i] for r in runs[flash_attn]]
                timed = [r for r in tries if not r.get("skipped")]
                best = dict(min(timed, key=lambda r: r["step_ms_median"]) if timed else tries[0])
                if len(timed) > 1:
                    best["step_ms_repeats"] = [r["step_ms_median"] for r in timed]
                rows.append(best)
        return rows

    def meta(self, forklm_dtype: str) -> dict:
        return {
            "binary": str(self.binary),
            "version": binary_version(self.binary),
            "source": f"llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist, vendor/llama.cpp ({BUILD_SCRIPT})"
                      if self.binary == DEFAULT_BINARY else f"${ENV_VAR}",
            "model": str(self.gguf),
            "weights": "as stored in the GGUF file (quantized)",
            "forklm_dtype": forklm_dtype,  # forklm dequantizes the GGUF's tensors to this dtype
            "threads": self.threads,
            "settings": "-pps (prompt prefilled once, shared), -kvu (unified KV), -fa off (impl llama.cpp) / "
                        "on (impl llama.cpp-fa); random tokens, no sampling",
            "timing": "decode loop timed as a whole: step_ms_median = decode_s / new_tokens (a mean), "
                      "tokens_per_s = n * new_tokens / decode_s; prefill_s = the shared prompt's decode",
        }
