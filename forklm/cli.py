"""Command line: `forklm sample ...` and `forklm bench ...` (also `python -m forklm`)."""

from __future__ import annotations

import argparse
import json
import sys

from forklm.models.registry import DEFAULT_MODEL
from forklm.speculative.config import SPECULATIVE_HELP


def _add_model_args(p: argparse.ArgumentParser) -> None:
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
                                metavar="{sample,info,serve,bench,bench-serve,bench-kernel,bench-constrained,bench-spec,bench-budget}")

    s = sub.add_parser("sample", help="draw n samples of one prompt", description="Draw n samples of one prompt; "
                       "print the best few by mean log-probability and a stats line.")
    _add_model_args(s)
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
    s.add_argument("--show", type=int, default=3, help="how many ranked samples to print (default: 3)")
    s.add_argument("--json", action="store_true", help="print every sample and the stats as JSON")

    b = sub.add_parser("bench", help="benchmark: context length x n, forklm paths vs transformers",
                       description="Sweep context length x n; per-step latency, tokens/s, prefill, memory, floor.")
    _add_model_args(b)
    b.add_argument("--contexts", default="256,1024,2048,4096", help="context lengths m_c (default: 256,1024,2048,4096)")
    b.add_argument("--ns", default="1,8,32,64", help="sample counts n (default: 1,8,32,64)")
    b.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sample (default: 64)")
    b.add_argument("--paths", default="standard,bifurcated,auto,single-request",
                   help="forklm paths to time: the engine with shared segments read standard, bifurcated or auto; "
                        "single-request: the reference stack LLM.sample ran before the engine")
    b.add_argument("--repeats", type=int, default=1,
                   help="run every implementation (transformers included) this many times per point, interleaved, and report each "
                        "one's fastest run (default: 1)")
    b.add_argument("--no-transformers", action="store_true", help="skip the Hugging Face transformers baseline")
    b.add_argument("--transformers-max-n", type=int, default=64, help="largest n run through transformers")
    b.add_argument("--transformers-max-tokens", type=int, default=2048 * 64,
                   help="skip transformers where n * m_c exceeds this (it prefills and stores n prompt copies) "
                        "(default: 131072)")
    b.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp's llama-batched-bench at the same points (same .gguf file, same threads, "
                        "shared prompt, unified KV, flash attention off and on); build it with "
                        "scripts/build_llama_cpp.sh or set $FORKLM_LLAMA_CPP_BIN")
    b.add_argument("--presets", default=None, metavar="LIST",
                   help="comma list of llama.cpp quantization presets (e.g. Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K_M,"
                        "Q4_K_M,Q5_K_M,Q6_K): each is made once from the .gguf model with llama-quantize "
                        "--allow-requantize into .cache/presets/ and the sweep runs on every file, with both engines' "
                        "peak RSS and load time per file (default: none, the model file as given)")
    b.add_argument("--out", default=None, help="JSON path (default: bench/results/sweep_<device>_<dtype>.json)")
    b.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    i = sub.add_parser("info", help="CPU features, native kernels built or why not, and how a model's weights run",
                       description="What this machine and a model get: the CPU features forklm's rules see, each "
                                   "native kernel built or why not, and per weight its stored type, kernel, layout and memory.")
    _add_model_args(i)
    i.add_argument("--no-model", action="store_true", help="the machine only (no model loaded)")
    i.add_argument("--json", action="store_true", help="print JSON")

    from forklm.bench.serve_workload import build_parser as serve_parser
    from forklm.bench.constrained import build_parser as constrained_parser
    from forklm.bench.kernel_bench import build_parser as kernel_parser
    from forklm.bench.spec import build_parser as spec_parser
    from forklm.bench.spec_budget import build_parser as budget_parser
    from forklm.server.cli import add_parser as server_parser

    server_parser(sub)
    serve_parser(sub)
    kernel_parser(sub)
    constrained_parser(sub)
    spec_parser(sub)
    budget_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sample":
            return _sample(args)
        if args.command == "info":
            return _info(args)
        if args.command == "serve":
            from forklm.server.cli import run as serve

            return serve(args)
        if args.command == "bench-kernel":
            from forklm.bench.kernel_bench import run_from_args as run_kernel

            return run_kernel(args)
        if args.command == "bench-constrained":
            from forklm.bench.constrained import run_from_args as run_constrained

            return run_constrained(args)
        if args.command == "bench-spec":
            from forklm.bench.spec import run_from_args as run_spec

            return run_spec(args)
        if args.command == "bench-budget":
            from forklm.bench.spec_budget import run_from_args as run_budget

            return run_budget(args)
        if args.command == "bench-serve":
            from forklm.bench.serve_workload import run_from_args as run_serve

            return run_serve(args)
        from forklm.bench.sweep import run_from_args

        return run_from_args(args)
    except KeyboardInterrupt:
        print("forklm: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, MemoryError, OSError) as e:
        print(f"forklm: error: {e}", file=sys.stderr)
        return 2


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


if __name__ == "__main__":
    sys.exit(main())
