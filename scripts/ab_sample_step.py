"""A decode step of `LLM.sample` in this tree against another commit's, in alternating processes.

    python scripts/ab_sample_step.py --against <commit> [--points 256x1,256x32,2048x32] [--rounds 2]
        [--model FILE.gguf] [--out bench/results/sample_step_ab.json]

Checks `--against` out into a temporary git worktree (its C++ extensions built into their own
FORKLM_CACHE_DIR / TORCH_EXTENSIONS_DIR), then per round and point (m_c x n: a random-token prompt of m_c tokens, n
samples, temperature 0.8, top-p 0.95, EOS ignored) runs one child process per tree, alternating:
each child warms up, then takes the step time as (a 33-token sample - a 1-token sample of the same
prompt, its prefix cached) / 32, three times, and reports the minimum and median. Run it alone
(`flock /tmp/forklm_bench.lock ...`); the first round also builds the other tree's extensions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, statistics, sys, time
import torch
from forklm import LLM
mc, n = (int(v) for v in sys.argv[1].split("x"))
llm = LLM(sys.argv[2]) if len(sys.argv) > 2 else LLM()
prompt = torch.randint(100, 40000, (mc,), generator=torch.Generator().manual_seed(0)).tolist()
kw = dict(temperature=0.8, top_p=0.95, seed=1, ignore_eos=True)
llm.sample(prompt, n=n, max_tokens=4, **kw)
steps = []
for _ in range(3):
    t0 = time.perf_counter()
    llm.sample(prompt, n=n, max_tokens=33, **kw)
    t1 = time.perf_counter()
    llm.sample(prompt, n=n, max_tokens=1, **kw)
    t2 = time.perf_counter()
    steps.append(((t1 - t0) - (t2 - t1)) / 32 * 1e3)
print(json.dumps({"step_ms_min": min(steps), "step_ms_median": statistics.median(steps)}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True)
    ap.add_argument("--points", default="256x1,256x32,2048x32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the packaged SmolLM2 Q4_1)")
    ap.add_argument("--out", default="bench/results/sample_step_ab.json")
    ap.add_argument("--this-first", action="store_true", help="run this tree's child before the other's each round")
    args = ap.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    sha = subprocess.run(["git", "rev-parse", "--short", args.against], cwd=root, check=True, capture_output=True,
                         text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True, capture_output=True,
                          text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="forklm_ab_"))
    tree = tmp / "tree"
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), sha], cwd=root, check=True)
    trees = {sha: (tree, {"TORCH_EXTENSIONS_DIR": str(tmp / "extensions"), "FORKLM_CACHE_DIR": str(tmp / "forklm-cache")}), f"this tree ({head})": (root, {})}
    if args.this_first:
        trees = dict(reversed(trees.items()))
    model = [str(Path(args.model).resolve())] if args.model else []
    res: dict[str, dict[str, list[dict]]] = {p: {name: [] for name in trees} for p in args.points.split(",")}
    try:
        for _ in range(args.rounds):
            for point in res:
                for name, (path, extra) in trees.items():
                    env = {**os.environ, **extra, "PYTHONPATH": str(path)}
                    out = subprocess.run([sys.executable, "-c", CHILD, point, *model], cwd=path, env=env, check=True,
                                         capture_output=True, text=True).stdout
                    r = json.loads(out.strip().splitlines()[-1])
                    res[point][name].append(r)
                    print(f"{point} {name}: step {r['step_ms_min']:.2f} ms min, {r['step_ms_median']:.2f} median")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=root, check=False)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's root: its bench/ package
    from bench.machine import machine_info

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "against": sha, "this_tree": head,
                               "model": args.model, "order": list(trees), "points": res}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
