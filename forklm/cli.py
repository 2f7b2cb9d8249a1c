"""Command line: `forklm sample | info | serve ...` (also `python -m forklm`); `forklm bench ...` forwards to the
benchmarks of a source checkout (`python -m bench ...`)."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from forklm.models.registry import DEFAULT_MODEL
from forklm.speculative.config import SPECULATIVE_HELP


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --device, --quantize (also the benchmarks' sweep)."""
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"model name, HF folder or .gguf file (default: {DEFAULT_MODEL})")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (CUDA) (default: auto)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda (default: auto)")
    p.add_argument("--quantize", default="auto",
                   help="weights kept quantized at run time (CPU): auto, none, int8, int4, gguf (a GGUF file's blocks as stored) (default: auto: gguf for a quantized .gguf on CPU, else none)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="forklm", description="Many samples from one context, fast and exact (bifurcated attention)."
    )
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{sample,info,serve,bench}")

    s = sub.add_parser("sample", help="draw n samples of one prompt", description="Draw n samples of one prompt; "
                       "print the best few by mean log-probability and a stats line.")
    add_model_args(s)
    s.add_argument("prompt", metavar="PROMPT", help="prompt text, or - to read it from stdin")
    s.add_argument("-n", type=int, default=8, help="number of samples (default: 8)")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens per sample at most (default: 64)")
    s.add_argument("--min-tokens", type=int, default=0, help="tokens per sample before EOS/stop may end it")
    s.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: 0.8)")
    s.add_argument("--top-p", type=float, default=0.95, help="nucleus mass in (0, 1] (default: 0.95)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    s.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message in the model's chat template")
    s.add_argument("--attention", default="auto", choices=["auto", "bifurcated", "standard"])
    s.add_argument("--speculative", default=None, metavar="SPEC", help=SPECULATIVE_HELP)
    s.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="end unfinished samples after this many seconds (finish reason 'time') (default: none)")
    s.add_argument("--beam-width", type=int, default=0, metavar="K",
                   help="beam search with K beams instead of sampling (transformers' num_beams rules); prints the "
                        "best hypotheses by score (the sampling knobs do not apply)")
    s.add_argument("--length-penalty", type=float, default=1.0, help="beam search: score = sum / length ** this")
    s.add_argument("--early-stopping", default="false", choices=["true", "false", "never"],
                   help="beam search: end at K finished (true), transformers' heuristic (false), or never")
    s.add_argument("--beam-groups", type=int, default=1, help="diverse beam search: groups of K / groups beams")
    s.add_argument("--diversity-penalty", type=float, default=0.0, help="diverse beam search: Hamming penalty")
    s.add_argument("--show", type=int, default=3, help="how many ranked samples to print (default: 3)")
    s.add_argument("--json", action="store_true", help="print every sample and the stats as JSON")

    i = sub.add_parser("info", help="CPU features, native kernels built or why not, and how a model's weights run",
                       description="What this machine and a model get: the CPU features forklm's rules see, each "
                                   "native kernel built or why not, and per weight its stored type, kernel, layout and memory.")
    add_model_args(i)
    i.add_argument("--no-model", action="store_true", help="the machine only (no model loaded)")
    i.add_argument("--json", action="store_true", help="print JSON")

    from forklm.server.cli import add_parser as server_parser

    server_parser(sub)
    sub.add_parser("bench", add_help=False, help="the benchmarks of a source checkout: forwards to `python -m bench` "
                                                  "(`forklm bench --help` lists them)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sample":
            return _sample(args)
        if args.command == "info":
            return _info(args)
        from forklm.server.cli import run as serve

        return serve(args)
    except KeyboardInterrupt:
        print("forklm: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, MemoryError, OSError) as e:
        print(f"forklm: error: {e}", file=sys.stderr)
        return 2


BENCH_ELSEWHERE = ("forklm: the benchmarks are not part of the installed package; run `python -m bench --help` "
                   "from the root of forklm's source checkout")


def _source_checkout() -> Path | None:
    """The checkout forklm runs from (its root holds pyproject.toml and bench/), or None (an installed wheel)."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "bench" / "cli.py").is_file() else None


def _bench(argv: list[str]) -> int:
    """`forklm bench ...`: hands the arguments to the benchmarks' command line (`python -m bench ...`) of
    the source checkout this forklm runs from (the `bench/` package beside `forklm/`); an installed
    wheel has none, and says so in one line."""
    root = _source_checkout()
    if root is None:
        print(BENCH_ELSEWHERE, file=sys.stderr)
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        bench_cli = importlib.import_module("bench.cli")
    except ImportError as e:
        print(f"{BENCH_ELSEWHERE} ({e})", file=sys.stderr)
        return 2
    return bench_cli.main(argv, prog="forklm bench")


def _info(args: argparse.Namespace) -> int:
    from forklm import LLM
    from forklm.info import format_report, report

    llm = None if args.no_model else LLM(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize)
    doc = report(llm)
    print(json.dumps(doc, indent=1) if args.json else format_report(doc))
    return 0


def _sample(args: argparse.Namespace) -> int:
    from forklm import LLM
    from forklm.speculative.config import SpeculativeConfig

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    spec = SpeculativeConfig.from_text(args.speculative)  # a bad spec fails before the model loads
    llm = LLM(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize, speculative=spec)
    if args.chat:
        prompt = [{"role": "user", "content": prompt}]
    if args.beam_width:
        return _beam_search(llm, prompt, args)
    out = llm.sample(
        prompt,
        n=args.n,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        attention=args.attention,
        time_budget_s=args.time_budget,
    )
    if args.json:
        doc = {
            "model": str(llm.source),
            "seed": out.seed,
            "samples": [
                {"index": s.index, "text": s.text, "token_ids": s.token_ids, "logprobs": s.logprobs,
                 "mean_logprob": s.mean_logprob, "cumulative_logprob": s.cumulative_logprob,
                 "finish_reason": s.finish_reason}
                for s in out.samples
            ],
            "stats": {**vars(out.stats), "tokens_per_s": out.stats.tokens_per_s},
        }
        print(json.dumps(doc, indent=1))
        return 0
    ranked = out.ranked(args.show)
    print(f"# {len(out.samples)} samples, {len(out.ranked())} distinct; best {len(ranked)} by mean log-probability "
          f"(seed {out.seed})\n")
    for rank, s in enumerate(ranked, 1):
        print(f"--- #{rank}  sample {s.index}  mean logprob {s.mean_logprob:.3f}  "
              f"({len(s.token_ids)} tokens, {s.finish_reason})")
        print(prompt + s.text if isinstance(prompt, str) else s.text)
        print()
    print(f"# {llm.dtype} on {llm.device} | {out.stats.summary()}")
    return 0


def _beam_search(llm, prompt, args: argparse.Namespace) -> int:
    early = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    out = llm.beam_search(prompt, args.beam_width, n=args.beam_width, max_tokens=args.max_tokens,
                          min_tokens=args.min_tokens, stop=args.stop, attention=args.attention,
                          length_penalty=args.length_penalty, early_stopping=early,
                          num_beam_groups=args.beam_groups, diversity_penalty=args.diversity_penalty)
    if args.json:
        doc = {"model": str(llm.source), "beam_width": args.beam_width,
               "hypotheses": [{"index": s.index, "text": s.text, "token_ids": s.token_ids, "logprobs": s.logprobs,
                               "score": s.score, "finish_reason": s.finish_reason} for s in out.samples],
               "stats": {**vars(out.stats), "tokens_per_s": out.stats.tokens_per_s}}
        print(json.dumps(doc, indent=1))
        return 0
    shown = out.samples[: args.show]
    print(f"# beam search, {args.beam_width} beams; best {len(shown)} hypotheses by score\n")
    for s in shown:
        print(f"--- #{s.index + 1}  score {s.score:.3f}  ({len(s.token_ids)} tokens, {s.finish_reason})")
        print(prompt + s.text if isinstance(prompt, str) else s.text)
        print()
    print(f"# {llm.dtype} on {llm.device} | {out.stats.summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
