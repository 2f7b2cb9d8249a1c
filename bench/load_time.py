"""Load time, forklm against llama.cpp, on the same GGUF files: fresh processes, rounds interleaved.

    python -m bench.load_time [--files A.gguf,B.gguf] [--rounds 3] [--threads 2]
        [--out bench/results/load_time_vs_llama_cpp_<cpu>.json]

forklm: `bench.presets`' probe process (imports torch and forklm, then times `LLM(path)`: load_s;
and to the first token of a 16-token prompt: load_first_eval_s). llama.cpp: `llama-batched-bench`
on the same file at one tiny point, its own `load time` line (model load to the end of its 16-token
warm-up decode, so the peer of load_first_eval_s). Default files: the packaged model and every
preset under .cache/presets/ (`python -m bench sweep --presets ...` makes them). Medians over
`--rounds`; run it alone (`flock /tmp/forklm_bench.lock ...`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench.presets import PRESET_DIR, file_info, forklm_probe, source_gguf


def default_files() -> list[Path]:
    return [source_gguf("smollm2-135m")] + sorted(PRESET_DIR.glob("*.gguf"))


def measure(files: list[Path], rounds: int, threads: int) -> list[dict]:
    from bench.llama_cpp import LlamaCppPeer, find_binary

    binary = find_binary()
    rows = []
    for path in files:
        fk, lc = [], []
        peer = LlamaCppPeer(binary, path, threads)
        for _ in range(rounds):  # interleaved, so a slow spell of the machine hits both
            probe = forklm_probe(path, "auto", "auto", threads, m_c=16, n=1, new_tokens=2)
            if "error" in probe:
                raise RuntimeError(f"{path.name}: {probe['error']}")
            fk.append(probe)
            peer.run(16, [1], 2, flash_attn=False)
            lc.append(peer.invocations[-1])
        row = {
            **file_info(path),
            "forklm_load_s": statistics.median(p["load_s"] for p in fk),
            "forklm_load_first_eval_s": statistics.median(p["load_first_eval_s"] for p in fk),
            "forklm_load_s_runs": [p["load_s"] for p in fk],
            "llama_cpp_load_s": statistics.median(i["load_s"] for i in lc if i["load_s"] is not None),
            "llama_cpp_load_s_runs": [i["load_s"] for i in lc],
            "forklm_command": fk[-1]["command"],
        }
        row["ratio_first_eval"] = row["forklm_load_first_eval_s"] / row["llama_cpp_load_s"]
        row["ratio_load"] = row["forklm_load_s"] / row["llama_cpp_load_s"]
        print(f"{path.name}: forklm load {row['forklm_load_s']:.2f} s (to the first token "
              f"{row['forklm_load_first_eval_s']:.2f} s), llama.cpp {row['llama_cpp_load_s']:.2f} s: "
              f"{row['ratio_first_eval']:.2f}x", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    from bench.machine import machine_info

    ap = argparse.ArgumentParser(prog="python -m bench.load_time", description=__doc__.splitlines()[0])
    ap.add_argument("--files", default=None, help="comma list of .gguf files (default: the packaged model and "
                                                   ".cache/presets/*.gguf)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    files = [Path(f) for f in a.files.split(",")] if a.files else default_files()
    machine = machine_info()
    rows = measure(files, a.rounds, a.threads)
    tag = "cpu_avx512" if machine.get("avx512") else "cpu_avx2" if machine.get("avx2") else "cpu"
    out = Path(a.out or f"bench/results/load_time_vs_llama_cpp_{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "rounds": a.rounds, "threads": a.threads, "files": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
