"""What a float16 KV cache costs in accuracy against the model's own dtype, through the engine.

    python -m bench.kv_dtype [--model smollm2-135m] [--tokens 256] [--out bench/results/kv_dtype_cpu.json]

For each weight configuration (float32 dense, `quantize=None`; float32 with the GGUF file's blocks,
`quantize="auto"`), the fixed prompts of `quant_accuracy` are continued greedily for `--tokens`
tokens by `LLM.generate` with `kv_dtype="model"` (float32 K/V) and `kv_dtype="float16"`: share of
positions whose tokens agree, mean common prefix, and over the common prefix the largest and mean
absolute difference of the chosen tokens' log-probabilities.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.machine import machine_info
from bench.quant_accuracy import PROMPTS


def compare(llm, tokens: int) -> dict:
    runs = {}
    for kv in ("model", "float16"):
        outs = llm.generate([{"prompt": p, "n": 1, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
                             for p in PROMPTS], kv_dtype=kv)
        runs[kv] = [o.samples[0] for o in outs]
    same = total = 0
    prefixes, diffs = [], []
    for a, b in zip(runs["model"], runs["float16"]):
        n = min(len(a.token_ids), len(b.token_ids))
        same += sum(x == y for x, y in zip(a.token_ids, b.token_ids))
        total += max(len(a.token_ids), len(b.token_ids))
        k = next((i for i in range(n) if a.token_ids[i] != b.token_ids[i]), n)
        prefixes.append(k)
        diffs.extend(abs(x - y) for x, y in zip(a.logprobs[:k], b.logprobs[:k]))
    return {"agreement": same / total, "common_prefix_mean": sum(prefixes) / len(prefixes),
            "common_prefix": prefixes, "logprob_abs_diff_max": max(diffs, default=0.0),
            "logprob_abs_diff_mean": sum(diffs) / max(len(diffs), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default="bench/results/kv_dtype_cpu.json")
    args = ap.parse_args(argv)
    from forklm import LLM

    results = {}
    for name, quantize in (("float32", None), ("float32+gguf", "auto")):
        llm = LLM(args.model, dtype="float32", device="cpu", quantize=quantize)
        results[name] = {"quantize": llm.quantize, **compare(llm, args.tokens)}
        print(json.dumps({name: {k: v for k, v in results[name].items() if k != "common_prefix"}}), flush=True)
        del llm
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "threads": torch.get_num_threads(), "model": args.model,
                               "tokens": args.tokens, "prompts": PROMPTS, "configs": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
