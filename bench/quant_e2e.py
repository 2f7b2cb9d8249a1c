"""Decode throughput of the default model per `quantize` setting (a quick check beside `python -m bench sweep`).

    flock /tmp/forklm_bench.lock .venv/bin/python -m bench.quant_e2e [--dtype bfloat16] [--ns 1,8,32]

A 256-token prompt of fixed ids, `LLM.sample(n, max_tokens=64, ignore_eos=True, seed=0)` after one
warm-up call; prints generated tokens/s over the decode phase, the median step and the weight bytes
held. `python -m bench sweep --quantize ...` is the full sweep.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> int:
    from forklm import LLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantize", default="none,gguf,int4,int8")
    ap.add_argument("--ns", default="1,8,32")
    args = ap.parse_args(argv)
    prompt = list(range(1000, 1256))
    print(f"# threads {torch.get_num_threads()}, prompt 256 tokens, 64 new tokens per sample")
    for q in args.quantize.split(","):
        t = time.time()
        llm = LLM(args.model, dtype=args.dtype, device="cpu", quantize=q)
        load = time.time() - t
        row = []
        for n in (int(x) for x in args.ns.split(",")):
            llm.sample(prompt, n=n, max_tokens=8, seed=0, ignore_eos=True)
            out = llm.sample(prompt, n=n, max_tokens=64, seed=0, ignore_eos=True)
            row.append(f"n={n}: {n * 63 / out.stats.decode_s:.0f} tok/s (median step {out.stats.median_step_s * 1e3:.1f} ms)")
        print(f"{q}: load {load:.1f} s, {llm.model.num_weight_bytes() / 2**20:.0f} MiB | " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
