"""llama.cpp as a peer in `python -m bench sweep --llama-cpp`: its `llama-batched-bench` at forklm's points.

The binary is built by scripts/build_llama_cpp.sh from the sources vendored in the pinned
llama-cpp-python sdist (or named by $FORKLM_LLAMA_CPP_BIN). One invocation per context length
m_c and flash-attention setting runs every n of the sweep:

    llama-batched-bench -m MODEL.gguf -npp m_c -ntg new_tokens -npl n1,n2,... -pps -kvu
        -fa off|on -t T -tb T -c m_c+max(n)*new_tokens --output-format jsonl -lv 4

-pps: the prompt is prefilled once and shared by the n sequences; -kvu: one unified KV buffer (the
shared prompt is stored once). It decodes the same GGUF file as stored (quantized), with
random prompt tokens and no sampling (the next tokens are random too, logits computed for every
row). Its decode loop is timed as a whole, so `step_ms_median` of its rows is decode_s /
new_tokens (a mean), and tokens_per_s = n * new_tokens / decode_s: decode steps (each n tokens) per
second of decoding, as forklm's rows count theirs (its prefill's logits make no token here).

Per invocation it also records the process's peak RSS (ru_maxrss taken by a small helper process,
see _RUSAGE_HELPER; the figure `/usr/bin/time -v` prints as "Maximum resident set size") and two load times from its log
on stderr (`-lv 4`: llama.cpp's info lines are below the default threshold of 3, so without it
stderr is empty; the flag changes nothing else):
  load_s   `llama_perf_context_print: load time = ... ms`: model load until the end of the first
           decode (its 16-token warm-up), so mmap's deferred page faults are inside it;
  ready_s  the log timestamp (from the log's start, ~ the process's) of the context constructor's
           `sched_reserve: reserve took` line: the model loaded and the context built, before any
           decode (this pinned version's log; None where the line is missing).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import REPO_ROOT

ENV_VAR = "FORKLM_LLAMA_CPP_BIN"
BUILD_SCRIPT = "scripts/build_llama_cpp.sh"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist the build script pins
DEFAULT_BINARY = REPO_ROOT / ".cache" / "llama.cpp" / f"build-{LLAMA_CPP_PYTHON_VERSION}" / "bin" / "llama-batched-bench"
IMPL = {False: "llama.cpp", True: "llama.cpp-fa"}  # flash attention off / on
# ik_llama.cpp (the fork with the iqk CPU kernels): the same llama-batched-bench, run with -rtr (every
# tensor repacked to its row-interleaved layouts at load); it prints a table, not JSON lines.
FLAVOR_ENV = "FORKLM_LLAMA_CPP_FLAVOR"
FLAVORS = ("llama.cpp", "ik_llama.cpp")
IMPLS = {"llama.cpp": IMPL, "ik_llama.cpp": {False: "ik_llama.cpp", True: "ik_llama.cpp-fa"}}
PEER_IMPLS = tuple(name for flavor in FLAVORS for name in IMPLS[flavor].values())


def flavor_of(binary: Path, environ: dict[str, str] | None = None) -> str:
    """$FORKLM_LLAMA_CPP_FLAVOR if set, else ik_llama.cpp for a binary under an ik_llama.cpp folder."""
    environ = os.environ if environ is None else environ
    named = environ.get(FLAVOR_ENV)
    if named:
        if named not in FLAVORS:
            raise ValueError(f"${FLAVOR_ENV} must be one of {FLAVORS}, got {named!r}")
        return named
    return "ik_llama.cpp" if "ik_llama" in str(binary) else "llama.cpp"


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
                          flash_attn: bool, flavor: str = "llama.cpp") -> list[str]:
    """The argument list of one invocation: every n at one m_c, one flash-attention setting."""
    if flavor == "ik_llama.cpp":  # its KV is one buffer already (no -kvu); -rtr: its repacked layouts
        return [str(binary), "-m", str(gguf),
                "-npp", str(m_c), "-ntg", str(new_tokens), "-npl", ",".join(str(n) for n in ns),
                "-pps", "-fa", "on" if flash_attn else "off", "-t", str(threads), "-tb", str(threads),
                "-c", str(context_size(m_c, ns, new_tokens)), "-b", "2048", "-ub", "512", "-rtr"]
    return [str(binary), "-m", str(gguf),
            "-npp", str(m_c), "-ntg", str(new_tokens), "-npl", ",".join(str(n) for n in ns),
            "-pps", "-kvu", "-fa", "on" if flash_attn else "off",
            "-t", str(threads), "-tb", str(threads),
            "-c", str(context_size(m_c, ns, new_tokens)), "-b", "2048", "-ub", "512",
            "--output-format", "jsonl", "-lv", "4"]  # -lv 4: the info lines with the load times


def parse_jsonl(text: str) -> list[dict]:
    """The result lines of `--output-format jsonl` (one JSON object per (pp, tg, pl)); log lines are skipped."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            rows.append(json.loads(line))
    return rows


_LOAD_TIME = re.compile(r"(?:llama_perf_context_print|llama_print_timings):\s*load time\s*=\s*([0-9.]+)\s*ms")
_TABLE_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([0-9.]+)\s*\|" * 6 + "$")
_TABLE_KEYS = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
_SETTINGS = re.compile(r"n_kv_max = (\d+), n_batch = (\d+), n_ubatch = (\d+), flash_attn = (\d+), is_pp_shared = "
                       r"(\d+), n_gpu_layers = (-?\d+), n_threads = (\d+), n_threads_batch = (\d+)")


def parse_table(text: str) -> list[dict]:
    """ik_llama.cpp's llama-batched-bench table rows (and its settings line) as the JSON lines' fields."""
    settings = _SETTINGS.search(text)
    common = {}
    if settings:
        keys = ("n_kv_max", "n_batch", "n_ubatch", "flash_attn", "is_pp_shared", "n_gpu_layers", "n_threads",
                "n_threads_batch")
        common = {k: int(v) for k, v in zip(keys, settings.groups())}
    rows = []
    for line in text.splitlines():
        m = _TABLE_ROW.match(line.strip())
        if m:
            vals = [int(v) for v in m.groups()[:4]] + [float(v) for v in m.groups()[4:]]
            rows.append({**common, **dict(zip(_TABLE_KEYS, vals))})
    return rows
LOAD_SOURCE_PERF = ("llama_perf_context_print 'load time' on stderr: model load to the end of the first decode "
                    "(the 16-token warm-up), median over invocations")
READY_SOURCE = ("log timestamp of the context constructor's 'sched_reserve: reserve took' line (log start ~ "
                "process start to model loaded + context built, before any decode), median over invocations")
LOAD_SOURCE_WALL = "wall time of a whole -npp 1 -ntg 1 -npl 1 run (no load time line on stderr)"
RSS_SOURCE = ("ru_maxrss of the llama-batched-bench process (a python -I -S helper, ~10 MiB resident, forks and "
              "execs it and waits with os.wait4; not RUSAGE_CHILDREN of the benchmark, which Linux floors at the "
              "benchmark's own peak), max over the file's invocations")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMP = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) ")  # common/log.cpp: minutes.seconds.ms.us


def parse_load_time_s(stderr: str) -> float | None:
    """llama.cpp's load time in seconds from its perf print on stderr (the last one), None if absent."""
    found = _LOAD_TIME.findall(stderr)
    return float(found[-1]) / 1e3 if found else None


def log_timestamp_s(line: str) -> float | None:
    """Seconds since the log started of one `-lv 4` log line ('0.00.205.452 I ...'), None if it has none."""
    m = _STAMP.match(_ANSI.sub("", line))
    if not m:
        return None
    minutes, sec, ms, us = (int(g) for g in m.groups())
    return minutes * 60 + sec + ms / 1e3 + us / 1e6


def parse_ready_s(stderr: str) -> float | None:
    """When the context was built: the timestamp of the first `sched_reserve: reserve took` line."""
    for line in stderr.splitlines():
        if "sched_reserve: reserve took" in line:
            return log_timestamp_s(line)
    return None


@dataclass
class Finished:
    """One finished child process: exit code, output, its own peak RSS and wall time."""

    returncode: int
    stdout: str
    stderr: str
    maxrss_mib: float | None  # None: the helper wrote no report
    wall_s: float | None


# Runs the command from a small python process (python -I -S: ~10 MiB resident) and writes the child's
# ru_maxrss (KiB) and wall time to argv[1]. Why not wait4 / RUSAGE_CHILDREN from the benchmark itself:
# Linux carries the parent's peak RSS into a child across fork/vfork + exec (exec_mmap keeps the old
# mm's high-water mark in signal->maxrss), so every child of a process holding torch and a model
# reports at least that process's peak. A small parent gives a small floor (what /usr/bin/time does).
_RUSAGE_HELPER = """
import os, sys, time
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    except OSError as e:
        os.write(2, f"cannot run {sys.argv[2]}: {e}\\n".encode())
    os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{usage.ru_maxrss} {time.perf_counter() - t0}")
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def measured_command(args: list[str], report: Path, python: str | None = None) -> list[str]:
    """`args` run under the rusage helper, which writes '<ru_maxrss KiB> <wall s>' to `report`."""
    return [python or sys.executable, "-I", "-S", "-c", _RUSAGE_HELPER, str(report), *map(str, args)]


def parse_report(text: str) -> tuple[float, float]:
    """The helper's report -> (peak RSS MiB, wall s)."""
    kib, wall = text.split()
    return int(kib) / 1024, float(wall)


def run_measured(args: list[str]) -> Finished:
    """Runs a command to its end; its own peak RSS (ru_maxrss of the process, see _RUSAGE_HELPER) and
    wall time come back with its output. A child killed by signal S exits 128 + S."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "rusage"
        done = subprocess.run(measured_command(args, report), capture_output=True, text=True, errors="replace")
        maxrss, wall = parse_report(report.read_text()) if report.is_file() else (None, None)
    return Finished(done.returncode, done.stdout, done.stderr, maxrss, wall)


def to_point(raw: dict, command: str, flavor: str = "llama.cpp") -> dict:
    """One llama-batched-bench result in forklm's row format (same field names where they mean the same)."""
    n, new_tokens = raw["pl"], raw["tg"]
    flash_attn = raw["flash_attn"] == 1  # llama_flash_attn_type: -1 auto, 0 disabled, 1 enabled
    return {
        "m_c": raw["pp"], "n": n, "impl": IMPLS[flavor][flash_attn],
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


def skipped_point(m_c: int, n: int, flash_attn: bool, reason: str, command: str, flavor: str = "llama.cpp") -> dict:
    return {"m_c": m_c, "n": n, "impl": IMPLS[flavor][flash_attn], "prefill_s": None, "decode_s": None, "e2e_s": None,
            "step_ms_median": None, "tokens_per_s": None, "peak_mem_mib": None, "floor_ms": None,
            "floor_naive_ms": None, "floor_fraction": None, "auto_paths": None, "flash_attn": flash_attn,
            "skipped": reason, "command": command}


def summarize_invocations(invocations: list[dict], tiny_run: Any = None) -> dict:
    """{"peak_rss_mib", "peak_rss_m_c", "load_s", "load_s_runs", "ready_s", "load_source", "rss_source"}
    of a file's invocations; `tiny_run()` (a Finished) times the load when no invocation printed one."""
    ok = [i for i in invocations if i["returncode"] == 0]
    ok_rss = [i for i in ok if i.get("peak_rss_mib") is not None]
    top = max(ok_rss, key=lambda i: i["peak_rss_mib"]) if ok_rss else None
    loads = [i["load_s"] for i in ok if i.get("load_s") is not None]
    readies = [i["ready_s"] for i in ok if i.get("ready_s") is not None]
    result = {"peak_rss_mib": top["peak_rss_mib"] if top else None, "peak_rss_m_c": top["m_c"] if top else None,
              "load_s": statistics.median(loads) if loads else None, "load_s_runs": loads,
              "ready_s": statistics.median(readies) if readies else None, "ready_s_runs": readies,
              "load_source": LOAD_SOURCE_PERF, "ready_source": READY_SOURCE, "rss_source": RSS_SOURCE}
    if not loads and tiny_run is not None:
        done = tiny_run()
        result.update(load_s=done.wall_s if done.returncode == 0 else None, load_source=LOAD_SOURCE_WALL)
    return result


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

    def __init__(self, binary: Path, gguf: Path, threads: int, flavor: str | None = None) -> None:
        self.binary, self.gguf, self.threads = Path(binary), Path(gguf), int(threads)
        self.flavor = flavor or flavor_of(self.binary)
        self.invocations: list[dict] = []  # per run: m_c, flash_attn, peak RSS, load time, exit code

    def run(self, m_c: int, ns: list[int], new_tokens: int, flash_attn: bool) -> list[dict]:
        """One invocation: a row per n, in the order of ns. A failed run or a missing result becomes a skipped row.
        Every row of the invocation carries its peak_rss_mib and load_s (one process ran them all)."""
        args = batched_bench_command(self.binary, self.gguf, m_c, ns, new_tokens, self.threads, flash_attn, self.flavor)
        command = " ".join(args)
        done = run_measured(args)
        load_s, ready_s = parse_load_time_s(done.stderr), parse_ready_s(done.stderr)
        self.invocations.append({"m_c": m_c, "ns": list(ns), "flash_attn": flash_attn, "returncode": done.returncode,
                                 "peak_rss_mib": done.maxrss_mib, "load_s": load_s, "ready_s": ready_s,
                                 "wall_s": done.wall_s})
        if done.returncode != 0:
            tail = " | ".join(done.stderr.strip().splitlines()[-3:])
            return [skipped_point(m_c, n, flash_attn, f"llama-batched-bench exited {done.returncode}: {tail}", command,
                                  self.flavor) for n in ns]
        raws = parse_table(done.stdout + "\n" + done.stderr) if self.flavor == "ik_llama.cpp" else parse_jsonl(done.stdout)
        by_n = {raw["pl"]: to_point(raw, command, self.flavor) for raw in raws}
        for row in by_n.values():
            row.update(peak_rss_mib=done.maxrss_mib, load_s=load_s, ready_s=ready_s)
        return [by_n.get(n) or skipped_point(m_c, n, flash_attn, "no result line from llama-batched-bench", command,
                                             self.flavor) for n in ns]

    def memory_and_load(self) -> dict:
        """Per file: peak RSS (the largest over this peer's invocations, and its m_c) and load time
        (the median of the parsed load times; without any, a timed -npp 1 -ntg 1 -npl 1 run)."""
        return summarize_invocations(self.invocations, self._timed_tiny_run)

    def _timed_tiny_run(self) -> Finished:
        return run_measured(batched_bench_command(self.binary, self.gguf, 1, [1], 1, self.threads, False, self.flavor))

    def run_context(self, m_c: int, ns: list[int], new_tokens: int, repeats: int = 1,
                    progress: Any = None) -> list[dict]:
        """Both flash-attention settings at one m_c, `repeats` times interleaved (off, on, off, on, ...);
        per point the run with the fastest decode counts (the others' steps kept as step_ms_repeats)."""
        runs: dict[bool, list[list[dict]]] = {False: [], True: []}
        for _ in range(repeats):
            for flash_attn in (False, True):
                if progress is not None:
                    progress.set_description(f"m_c={m_c} n={','.join(map(str, ns))} {IMPLS[self.flavor][flash_attn]}")
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
            "flavor": self.flavor,
            "settings": ("-pps (prompt prefilled once, shared), -rtr (run-time repacking), -fa off (impl "
                         "ik_llama.cpp) / on (impl ik_llama.cpp-fa); random tokens, no sampling"
                         if self.flavor == "ik_llama.cpp" else
                         "-pps (prompt prefilled once, shared), -kvu (unified KV), -fa off (impl llama.cpp) / "
                         "on (impl llama.cpp-fa); random tokens, no sampling"),
            "timing": "decode loop timed as a whole: step_ms_median = decode_s / new_tokens (a mean), "
                      "tokens_per_s = n * new_tokens / decode_s (new_tokens decode steps of n tokens each); "
                      "prefill_s = the shared prompt's decode",
            "load_time": {"load_s": LOAD_SOURCE_PERF, "ready_s": READY_SOURCE,
                          "fallback": LOAD_SOURCE_WALL + " (files[].llama_cpp.load_source says which)"},
            "rss": RSS_SOURCE + "; per row: peak_rss_mib of the invocation that ran it (every n of its m_c)",
        }
