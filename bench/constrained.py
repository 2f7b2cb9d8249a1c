"""Constrained decoding: 64 samples of a nested JSON schema, masks only vs jump-forward vs
unconstrained generation of the same length.

    python -m bench constrained [--model smollm2-135m] [--n 64] [--repeats 1] [--out bench/results/constrained_cpu.json]

For each mode the engine runs one request of n samples (same prompt, same seed) to the end; the
bench times every engine step and records steps, wall time, tokens, the share of samples that
validate (`jsonschema`), and the grammar's cost: the time llguidance spent computing masks (on
the mask worker, overlapped with the forward) and the time the step waited for them. "Mask
added" compares the median decode step of the masks-only run with the unconstrained run's at the
same rows (n) and similar lengths: everything constraints add to a step (mask, waiting for it,
applying it, the matchers' consume).

The distribution part draws `--dist-n` samples masks-only and with jump-forward on the same seed
and compares them: how many samples are identical, the enum fields' value distributions (total
variation distance), lengths, and the mean log-prob per token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections import Counter
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "title": {"type": "string", "maxLength": 32},
        "severity": {"enum": ["low", "medium", "high", "critical"]},
        "component": {"enum": ["engine", "scheduler", "server", "tokenizer", "kernels"]},
        "labels": {"type": "array", "items": {"enum": ["bug", "perf", "docs", "test"]}, "minItems": 1, "maxItems": 3},
        "reporter": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 16}, "verified": {"type": "boolean"}},
            "required": ["name", "verified"],
            "additionalProperties": False,
        },
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"action": {"enum": ["open", "click", "type", "wait"]},
                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["action", "count"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["id", "title", "severity", "component", "labels", "reporter", "steps"],
    "additionalProperties": False,
}
PROMPT = "A bug report for an inference engine, as one JSON object:\n"
ENUM_FIELDS = ("severity", "component")


def build_parser(sub=None) -> argparse.ArgumentParser:
    kw = {"help": "constrained decoding (JSON schema), masks only vs jump-forward vs unconstrained",
              "description": __doc__.split("\n\n")[0]}
    p = sub.add_parser("constrained", **kw) if sub is not None else argparse.ArgumentParser(description=kw["description"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--n", type=int, default=64, help="samples per run (default: 64)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per sample at most (default: 256)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="runs of each mode, interleaved; the fastest is kept")
    p.add_argument("--dist-n", type=int, default=256, help="samples per mode for the distribution part (0: skip)")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/constrained_<device>.json)")
    return p


def _validates(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@contextlib.contextmanager
def _timed_decode_attention(acc: list[float]):
    """Adds the time spent in the decode rows' attention (all layers) to acc[0] while active."""
    from forklm.attention.paged import PagedAttention

    original = PagedAttention._decode

    def timed(self, *args):
        t = time.perf_counter()
        out = original(self, *args)
        acc[0] += time.perf_counter() - t
        return out

    PagedAttention._decode = timed
    try:
        yield
    finally:
        PagedAttention._decode = original


def run_mode(llm, mode: str, n: int, max_tokens: int, seed: int, length: int | None = None) -> dict:
    """One request of n samples on a fresh engine, every step timed."""
    from forklm import Request

    if mode == "unconstrained":
        req = Request(PROMPT, n=n, max_tokens=length, min_tokens=length, ignore_eos=True, seed=seed)
    else:
        req = Request(PROMPT, n=n, max_tokens=max_tokens, seed=seed, json_schema=SCHEMA,
                      jump_forward=(mode == "jump-forward"))
    engine = llm.engine()
    masks = engine.output.masks
    st = engine.add_request(llm.prompt_token_ids(PROMPT), req.params())
    step_s, rows, attention = [], [], [0.0]
    t0 = time.perf_counter()
    with _timed_decode_attention(attention):
        while engine.has_unfinished():
            running = sum(len(r.running) for r in engine.active)
            t = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t)
            rows.append(running)
    wall = time.perf_counter() - t0
    engine.check_integrity()
    assert engine.blocks_in_use() == 0
    if st.error is not None:
        raise st.error
    samples = st.output.samples
    lengths = [len(s.token_ids) for s in samples]
    full = [s for r, s in zip(rows, step_s) if r == n]  # decode steps with every sample running
    out = {
        "mode": mode,
        "steps": engine.metrics.steps,
        "extends": engine.metrics.extends,
        "extend_tokens": engine.metrics.extend_tokens,
        "wall_s": round(wall, 3),
        "decode_attention_s": round(attention[0], 3),
        "tokens": sum(lengths),
        "tokens_per_sample_mean": round(statistics.mean(lengths), 2),
        "tokens_per_sample_max": max(lengths),
        "tokens_per_s": round(sum(lengths) / wall, 1),
        "median_step_s_all_rows": round(statistics.median(full), 4) if full else None,
        "steps_all_rows": len(full),
        "mask_compute_s": round(masks.compute_s, 3),
        "mask_wait_s": round(masks.wait_s, 3),
        "masks": masks.masks,
    }
    if mode != "unconstrained":
        out["valid"] = sum(_validates(s.text) for s in samples)
        out["finish_reasons"] = dict(Counter(s.finish_reason for s in samples))
        out["mask_compute_share_of_wall"] = round(masks.compute_s / wall, 4)
        out["mask_wait_share_of_wall"] = round(masks.wait_s / wall, 4)
    return out, samples


def distribution(llm, n: int, max_tokens: int, seed: int) -> dict:
    """Masks only vs jump-forward on the same seed: how different are the samples?"""
    from forklm import Request

    result = {}
    texts = {}
    for mode in ("masks-only", "jump-forward"):
        req = Request(PROMPT, n=n, max_tokens=max_tokens, seed=seed, json_schema=SCHEMA,
                      jump_forward=(mode == "jump-forward"))
        out = llm.generate([req])[0]
        samples = out.samples
        texts[mode] = [s.text for s in samples]
        parsed = [json.loads(s.text) for s in samples if _validates(s.text)]
        result[mode] = {
            "valid": len(parsed),
            "tokens_per_sample_mean": round(statistics.mean(len(s.token_ids) for s in samples), 2),
            "chars_per_sample_mean": round(statistics.mean(len(s.text) for s in samples), 1),
            "mean_logprob_per_token": round(statistics.mean(lp for s in samples for lp in s.logprobs), 4),
            **{field: dict(Counter(p[field] for p in parsed)) for field in ENUM_FIELDS},
            "labels_per_sample_mean": round(statistics.mean(len(p["labels"]) for p in parsed), 3),
            "steps_per_sample_mean": round(statistics.mean(len(p["steps"]) for p in parsed), 3),
        }
    a, b = result["masks-only"], result["jump-forward"]
    result["identical_samples"] = sum(x == y for x, y in zip(texts["masks-only"], texts["jump-forward"]))
    result["n"] = n
    for field in ENUM_FIELDS:
        keys = set(a[field]) | set(b[field])
        result[f"{field}_tvd"] = round(0.5 * sum(abs(a[field].get(k, 0) / a["valid"] - b[field].get(k, 0) / b["valid"])
                                                 for k in keys), 4)
    return result


def run_from_args(args: argparse.Namespace) -> int:
    from forklm import LLM
    from bench.machine import machine_info
    from bench.sweep import write_json

    llm = LLM(args.model, dtype=args.dtype)
    llm.sample(PROMPT, n=2, max_tokens=8, seed=0, json_schema=SCHEMA)  # warm-up: compile, bind the tokenizer
    best: dict[str, dict] = {}
    length = None
    for rep in range(args.repeats):
        for mode in ("masks-only", "jump-forward", "unconstrained"):
            res, _ = run_mode(llm, mode, args.n, args.max_tokens, args.seed, length)
            if mode == "masks-only" and length is None:
                length = round(res["tokens_per_sample_mean"])  # the unconstrained run's length
            print(f"[{rep + 1}/{args.repeats}] {mode}: {res['steps']} steps, {res['wall_s']} s, "
                  f"median step {res['median_step_s_all_rows']} s, valid {res.get('valid', '-')}/{args.n}", flush=True)
            if mode not in best or res["wall_s"] < best[mode]["wall_s"]:
                best[mode] = res
    masked, jump, free = best["masks-only"], best["jump-forward"], best["unconstrained"]
    summary = {
        "step_ratio_masked_over_jump": round(masked["steps"] / jump["steps"], 3),
        "time_ratio_masked_over_jump": round(masked["wall_s"] / jump["wall_s"], 3),
        "valid_share": (masked["valid"] + jump["valid"]) / (2 * args.n),
    }
    if masked["median_step_s_all_rows"] and free["median_step_s_all_rows"]:
        summary["constraint_added_to_step"] = round(
            masked["median_step_s_all_rows"] / free["median_step_s_all_rows"] - 1, 4)
        summary["mask_wait_per_step_s"] = round(masked["mask_wait_s"] / masked["steps"], 5)
        summary["mask_compute_per_step_s"] = round(masked["mask_compute_s"] / masked["steps"], 5)
        summary["mask_wait_share_of_step"] = round(summary["mask_wait_per_step_s"] / masked["median_step_s_all_rows"], 4)
        summary["mask_compute_share_of_step"] = round(
            summary["mask_compute_per_step_s"] / masked["median_step_s_all_rows"], 4)
    doc = {
        "bench": "constrained",
        "model": str(llm.source),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "device": llm.device.type,
        "machine": machine_info(),
        "n": args.n,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "repeats": args.repeats,
        "schema": SCHEMA,
        "prompt": PROMPT,
        "modes": best,
        "summary": summary,
    }
    if args.dist_n:
        doc["distribution"] = distribution(llm, args.dist_n, args.max_tokens, args.seed + 1)
    print(json.dumps(summary, indent=1))
    if "distribution" in doc:
        d = doc["distribution"]
        print(f"distribution ({d['n']} samples): identical {d['identical_samples']}, "
              + ", ".join(f"{f} TVD {d[f + '_tvd']}" for f in ENUM_FIELDS))
    path = Path(args.out or f"bench/results/constrained_{llm.device.type}.json")
    write_json(doc, path)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
