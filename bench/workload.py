"""The serving workload's parts shared by the in-process run (serve_workload.py) and the HTTP run
(http_workload.py): the workload itself, its prompt pool, the best possible prefix hit rate, and one
configuration's result."""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field

from forklm.cache.block_pool import BlockPool
from forklm.cache.radix_cache import RadixCache
from forklm.sampling.params import SamplingParams


@dataclass
class Workload:
    prompts: list[list[int]]  # in arrival order
    arrivals: list[float]  # seconds after start
    params: list[SamplingParams]
    groups: list[int]  # system prompt of each request


SOURCE_MODULES = ("argparse", "collections", "json.decoder", "heapq", "textwrap", "difflib", "fractions",
                  "shlex", "string", "bisect", "functools", "dataclasses", "csv", "statistics", "graphlib")


def code_token_pool(tokenize) -> list[list[int]]:
    """Token ids of Python standard-library source files: real code, present wherever Python is."""
    import importlib
    import inspect

    return [tokenize(inspect.getsource(importlib.import_module(m))) for m in SOURCE_MODULES]


def make_workload(args: argparse.Namespace, sources: list[list[int]]) -> Workload:
    """System prompts: the first `system_tokens` tokens of different source files (a file a code
    assistant is working on); user prompts: `user_tokens` tokens from random places of the others."""
    rng = random.Random(args.seed)
    if args.systems > len(sources) - 1:
        raise ValueError(f"--systems: at most {len(sources) - 1} with the bundled sources")
    if any(len(src) < args.system_tokens for src in sources[: args.systems]):
        raise ValueError(f"--system-tokens: some source files are shorter than {args.system_tokens} tokens")
    systems = [src[: args.system_tokens] for src in sources[: args.systems]]
    others = [src for src in sources[args.systems :] if len(src) > args.user_tokens]
    reqs = []
    for s, system in enumerate(systems):
        for _ in range(args.users):
            src = rng.choice(others)
            at = rng.randrange(0, len(src) - args.user_tokens)
            reqs.append((s, system + src[at : at + args.user_tokens]))
    rng.shuffle(reqs)
    arrivals = sorted(rng.uniform(0, args.arrival_s) for _ in reqs)
    params = [
        SamplingParams(n=args.n, max_tokens=args.new_tokens, temperature=0.8, top_p=0.95, seed=1000 + i, ignore_eos=True)
        for i in range(len(reqs))
    ]
    return Workload([p for _, p in reqs], arrivals, params, [s for s, _ in reqs])


def best_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """Hit rate with an unbounded cache: every distinct full block computed once, the last
    prompt token always recomputed (the engine's rule)."""
    total = sum(len(p) for p in prompts)
    pool = BlockPool(sum(len(p) // block_size + 1 for p in prompts), block_size)
    cache = RadixCache(pool)
    hit = 0
    for p in prompts:
        m = cache.match_prefix(p)
        hit += m.num_tokens
        full = len(p) // block_size
        blocks = pool.allocate(full)
        cache.insert(p[: full * block_size], blocks)
        pool.decref(blocks)
    return hit / total


@dataclass
class RunResult:
    name: str
    options: dict
    makespan_s: float = 0.0
    generated_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)

    def summary(self) -> dict:
        def pct(xs, q):
            return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else (xs[0] if xs else None)

        return {
            "name": self.name,
            "options": self.options,
            "makespan_s": self.makespan_s,
            "generated_tokens": self.generated_tokens,
            "throughput_tok_s": self.generated_tokens / self.makespan_s if self.makespan_s else 0.0,
            "ttft_p50_s": pct(self.ttft_s, 50),
            "ttft_p90_s": pct(self.ttft_s, 90),
            "ttft_p99_s": pct(self.ttft_s, 99),
            "itl_p50_ms": pct(self.itl_s, 50) * 1e3 if self.itl_s else None,
            "itl_p90_ms": pct(self.itl_s, 90) * 1e3 if self.itl_s else None,
            "itl_p99_ms": pct(self.itl_s, 99) * 1e3 if self.itl_s else None,
            **self.metrics,
        }
