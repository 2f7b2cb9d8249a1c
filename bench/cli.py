"""`python -m bench <command> ...`: forklm's benchmarks as one command line (run from the checkout's root).

`forklm bench <command> ...` forwards here from a source checkout; the wheel holds the engine only.
"""

from __future__ import annotations

import argparse
import importlib
import sys

PROG = "python -m bench"

# sub-command: the module that defines its options (build_parser(sub)) and runs it (run_from_args(args))
COMMANDS = {
    "sweep": "bench.sweep",
    "serve": "bench.serve_workload",
    "kernel": "bench.kernel_bench",
    "constrained": "bench.constrained",
    "spec": "bench.spec",
    "budget": "bench.spec_budget",
}

# studies with their own options, run as `python -m bench.<module> --help`
MODULES = ("attention_sweep", "block_kernel_crossover", "block_kernel_step", "distinct_prompts",
           "gguf_kernels", "kv_dtype", "load_time", "metrics_scrape", "plot", "quant_accuracy", "quant_e2e",
           "quant_kernels", "self_draft", "serve_soak", "step_overhead")

EPILOG = ("`<command> --help` gives a command's options. More measurements run on their own, "
          "`python -m bench.<module> --help` (or `python -m bench <module> --help`): " + ", ".join(MODULES) +
          ". Results go to bench/results/ by default; "
          "run benchmarks alone on the machine (flock /tmp/forklm_bench.lock ...).")


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, epilog=EPILOG,
                                     description="forklm's benchmarks: forklm against transformers and llama.cpp, "
                                                 "the serving workload, kernels, constrained and speculative sampling.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for module in COMMANDS.values():
        importlib.import_module(module).build_parser(sub)
    return parser


def run_module(name: str, argv: list[str], prog: str = PROG) -> int:
    """Runs the study `bench.<name>` (one of MODULES) as `python -m bench.<name> argv...` would: its
    main() reads sys.argv, set here for the call."""
    module = importlib.import_module("bench." + name)
    saved = sys.argv
    sys.argv = [f"{prog} {name}", *argv]
    try:
        return module.main() or 0
    finally:
        sys.argv = saved


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Runs one benchmark, or one study of MODULES; returns its exit code (2 for bad options or files,
    130 when interrupted)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in MODULES:
        try:
            return run_module(argv[0], argv[1:], prog)
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            return 130
    try:
        parser = build_parser(prog)
    except ImportError as e:  # a benchmark's dependency (pyproject's `bench` extra)
        print(f"{prog}: {e}; `pip install -e '.[bench]'` installs what the benchmarks need", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    run = importlib.import_module(COMMANDS[args.command]).run_from_args
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, MemoryError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
