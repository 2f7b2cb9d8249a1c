"""`python -m bench serve`: concurrent requests sharing prefixes at several levels, with ablations.

Workload (all sizes are options): S system prompts of `--system-tokens` tokens, each followed by
U user prompts of `--user-tokens` tokens (S·U requests), each asking for n samples of
`--new-tokens` tokens (EOS ignored, so every configuration does the same work). Requests arrive
at uniformly random times over `--arrival-s` seconds, in random order. The text is real code:
system prompts are the beginnings of Python standard-library modules (the file a code assistant
works on), user prompts are snippets of other modules.

Configurations, each on a fresh engine (cold cache) in one process, the same workload:
    all-on            radix prefix cache + cache-aware order + shared-prefix attention (auto rule)
    no-shared-attn    every decode row reads its whole KV itself ("standard")
    no-radix          no prefix cache: every request prefills its whole prompt
    fcfs              first come, first served; no waiting for a sibling's prefill
    all-off           all three off

Each run goes through `EngineLoop` (the engine on its thread, a client thread submitting at the
arrival times), and reports throughput (generated tokens / makespan), time to first token and
inter-token latency percentiles, and the prefix hit rate next to the best achievable (every
distinct full block of the workload's prompts computed once). Then, on the all-on engine while
idle, the TTFT of a new request whose system prompt is cached against one whose is not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path


from bench.machine import machine_info
from forklm.engine.loop import EngineLoop
from forklm.sampling.params import SamplingParams
from bench.workload import RunResult, Workload, best_hit_rate, code_token_pool, make_workload

CONFIGS = {
    "all-on": dict(prefix_cache=True, schedule="cache-aware", shared_attention="auto", defer_shared_prefill=True),
    "no-shared-attn": dict(prefix_cache=True, schedule="cache-aware", shared_attention="standard", defer_shared_prefill=True),
    "no-radix": dict(prefix_cache=False, schedule="cache-aware", shared_attention="auto", defer_shared_prefill=False),
    "fcfs": dict(prefix_cache=True, schedule="fcfs", shared_attention="auto", defer_shared_prefill=False),
    "all-off": dict(prefix_cache=False, schedule="fcfs", shared_attention="standard", defer_shared_prefill=False),
}


def run_config(llm, name: str, options: dict, wl: Workload, engine_args: dict, progress) -> tuple[RunResult, EngineLoop]:
    """The workload through `EngineLoop`, submitted at its arrival times and consumed by one
    asyncio thread (one consumer thread per request would contend with the engine for the GIL)."""
    engine = llm.engine(**engine_args, **options)
    loop = EngineLoop(engine)
    res = RunResult(name, options)

    async def main() -> None:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + wl.arrivals[i] - time.perf_counter()))
            submitted = time.perf_counter()
            stream = loop.submit(wl.prompts[i], wl.params[i], request_id=f"{name}-{i}")
            last: dict[int, float] = {}
            async for batch in stream.batches():
                now = time.perf_counter()
                if not last:
                    res.ttft_s.append(now - submitted)
                for ev in batch:
                    if ev.sample_index in last:
                        res.itl_s.append(now - last[ev.sample_index])
                    last[ev.sample_index] = now
                res.generated_tokens += len(batch)
                progress(len(batch))

        await asyncio.gather(*(one(i) for i in range(len(wl.prompts))))
        res.makespan_s = time.perf_counter() - t0

    asyncio.run(main())
    m = engine.metrics
    res.metrics = {
        "prefix_hit_rate": m.prefix_hit_rate,
        "computed_tokens": m.computed_tokens,
        "steps": m.steps,
        "preempted_samples": m.preempted_samples,
        "preempted_requests": m.preempted_requests,
        "shared_segment_reads": m.shared_reads,
        "blocks_in_use_after": engine.blocks_in_use(),
    }
    return res, loop


def ttft_probe(loop: EngineLoop, wl: Workload, args: argparse.Namespace, sources: list[list[int]]) -> dict:
    """TTFT of a new request on an idle engine: system prompt cached vs not (median of 3)."""
    rng = random.Random(args.seed + 1)
    params = SamplingParams(n=args.n, max_tokens=1, seed=0)
    cached, uncached = [], []
    system0 = wl.prompts[wl.groups.index(0)][: args.system_tokens]
    other = sources[-1]
    for i in range(3):
        at = rng.randrange(0, len(other) - args.user_tokens)
        user = other[at : at + args.user_tokens]
        # the same file from a token no request started at: nothing of it is cached
        fresh_system = sources[i][1 : args.system_tokens + 1]
        for prompt, out in ((system0 + user, cached), (fresh_system + user, uncached)):
            t = time.perf_counter()
            stream = loop.submit(prompt, params)
            next(iter(stream))
            out.append(time.perf_counter() - t)
            stream.result()
    c, u = statistics.median(cached), statistics.median(uncached)
    return {"ttft_cached_s": c, "ttft_uncached_s": u, "ratio": c / u}


def command_line() -> str:
    """The invocation as typed (`python -m bench serve ...`, or `forklm bench serve ...` forwarded to it);
    empty when this did not start from the bench CLI."""
    argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        argv = argv[1:]
    return "python -m bench " + " ".join(argv) if argv[:1] == ["serve"] else ""


def build_parser(sub=None) -> argparse.ArgumentParser:
    desc = "Concurrent requests sharing prefixes at several levels; ablations of the prefix cache, cache-aware order and shared-prefix attention."
    p = sub.add_parser("serve", help="a shared-prefix serving workload with ablations",
                       description=desc) if sub else argparse.ArgumentParser(description=desc)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantize", default="auto", help="auto, none, int8, int4, gguf (see forklm sample --help)")
    p.add_argument("--device", default="auto")
    p.add_argument("--systems", type=int, default=4, help="system prompts (default: 4)")
    p.add_argument("--system-tokens", type=int, default=1024, help="tokens per system prompt (default: 1024)")
    p.add_argument("--users", type=int, default=16, help="user prompts per system prompt (default: 16)")
    p.add_argument("--user-tokens", type=int, default=200, help="tokens per user prompt (default: 200)")
    p.add_argument("-n", type=int, default=16, help="samples per request (default: 16)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per sample (default: 64)")
    p.add_argument("--arrival-s", type=float, default=20.0, help="requests arrive uniformly over this window (default: 20)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"which of {list(CONFIGS)} to run")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--memory-gib", type=float, default=3.0, help="KV pool size (default: 3 GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--http", action="store_true",
                   help="also send the workload over HTTP to a `forklm serve` child process (all-on engine) and "
                        "report the overhead against the in-process run; implies --configs all-on unless given")
    p.add_argument("--out", default=None,
                   help="JSON path (default: bench/results/serve[_http]_<device>_<dtype>.json)")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    return p


def run_from_args(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from forklm import LLM
    from bench.sweep import dtype_name

    if args.http and args.configs == ",".join(CONFIGS):
        args.configs = "all-on"
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    llm = LLM(args.model, dtype=args.dtype, device=args.device, quantize=getattr(args, "quantize", "auto"))
    sources = code_token_pool(lambda text: llm.tokenizer.encode(text, add_special_tokens=False))
    wl = make_workload(args, sources)
    engine_args = dict(block_size=args.block_size, max_batch_tokens=args.max_batch_tokens,
                       memory_budget=int(args.memory_gib * 2**30))
    best = best_hit_rate(wl.prompts, args.block_size)
    total = len(wl.prompts) * args.n * args.new_tokens
    # warm-up: one small request through a throwaway engine (allocator, kernels)
    warm = llm.engine(**engine_args)
    warm.add_request(wl.prompts[0][:64], SamplingParams(n=2, max_tokens=4, seed=0))
    warm.run()
    del warm
    results, probe, http_overhead, idle_engine = [], None, None, None
    idle_prompt = sources[-1][:64]  # one small request on an idle engine, for the HTTP comparison
    for name in names:
        bar = tqdm(total=total, desc=name, unit="tok", file=sys.stderr)
        res, loop = run_config(llm, name, CONFIGS[name], wl, engine_args, bar.update)
        bar.close()
        if name == "all-on":
            probe = ttft_probe(loop, wl, args, sources)
            if args.http:
                from bench.http_workload import idle_ttft_engine

                idle_engine = idle_ttft_engine(loop, idle_prompt)
        loop.close()
        results.append(res.summary())
        s = results[-1]
        print(f"{name:>15}: {s['throughput_tok_s']:7.1f} tok/s, makespan {s['makespan_s']:.1f} s, "
              f"TTFT p50 {s['ttft_p50_s']:.2f} s, ITL p50 {s['itl_p50_ms']:.0f} ms, "
              f"hit rate {s['prefix_hit_rate']:.3f} (best {best:.3f})", file=sys.stderr)
    if args.http:
        from bench.http_workload import idle_ttft_http, overhead, run_http, server_args
        from forklm.server.process import ServerProcess

        with ServerProcess(*server_args(args, engine_args), model=args.model) as server:
            idle_http = idle_ttft_http(server.url, args.model, idle_prompt)
            bar = tqdm(total=total, desc="all-on over HTTP", unit="tok", file=sys.stderr)
            res = run_http(server.url, args.model, wl, bar.update)
            bar.close()
            m = server.metrics()
        res.metrics = {"prefix_hit_rate": m["forklm_prefix_cache_hit_rate"], "steps": m["forklm_step_seconds_count"],
                       "blocks_in_use_after": m["forklm_kv_blocks_in_use"]}
        results.append(res.summary())
        in_process = next(r for r in results if r["name"] == "all-on")
        http_overhead = overhead(in_process, results[-1], idle_engine, idle_http)
    doc = {
        "meta": {
            "command": command_line(),
            "model": str(llm.source),
            "dtype": dtype_name(llm.dtype),
            "device": llm.device.type,
            **machine_info(),  # CPU model and vector features, threads, torch
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "workload": {k: getattr(args, k) for k in ("systems", "system_tokens", "users", "user_tokens", "n",
                                                         "new_tokens", "arrival_s", "seed")},
            "engine": engine_args,
            "best_hit_rate": best,
        },
        "runs": results,
        "ttft_probe": probe,
        "http_overhead": http_overhead,
    }
    kind = "serve_http" if args.http else "serve"
    out = Path(args.out or f"bench/results/{kind}_{llm.device.type}_{dtype_name(llm.dtype)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    try:
        png = Path(args.plot) if args.plot else out.with_suffix(".png")
        plot_serve(doc, png)
        print(f"wrote {png}", file=sys.stderr)
    except ImportError as e:
        print(f"no plot ({e})", file=sys.stderr)
    print(markdown_table(doc))
    return 0


def markdown_table(doc: dict) -> str:
    best = doc["meta"]["best_hit_rate"]
    base = next((r for r in doc["runs"] if r["name"] == "all-off"), None)
    base_name = "all-off"
    if base is None and doc.get("http_overhead"):
        base, base_name = next(r for r in doc["runs"] if r["name"] == "all-on"), "all-on"
    lines = [
        f"| config | tok/s | vs {base_name} | TTFT p50 / p90 (s) | ITL p50 / p90 (ms) | prefix hit rate (best) |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        rel = f"{r['throughput_tok_s'] / base['throughput_tok_s']:.2f}x" if base else "-"
        lines.append(
            f"| {r['name']} | {r['throughput_tok_s']:.0f} | {rel} | {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} | "
            f"{r['itl_p50_ms']:.0f} / {r['itl_p90_ms']:.0f} | {r['prefix_hit_rate']:.3f} ({best:.3f}) |"
        )
    if doc.get("ttft_probe"):
        p = doc["ttft_probe"]
        lines.append("")
        lines.append(f"Idle TTFT, cached system prompt {p['ttft_cached_s']:.3f} s vs uncached {p['ttft_uncached_s']:.3f} s "
                     f"(ratio {p['ratio']:.2f})")
    if doc.get("http_overhead"):
        from bench.http_workload import markdown_overhead

        lines.append("")
        lines.append(markdown_overhead(doc["http_overhead"]))
    return "\n".join(lines)


def plot_serve(doc: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    names = [r["name"] for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(names, [r["throughput_tok_s"] for r in runs], color="tab:blue")
    axes[0].set_ylabel("generated tok/s")
    axes[0].set_title("throughput")
    x = range(len(runs))
    axes[1].bar([i - 0.2 for i in x], [r["ttft_p50_s"] for r in runs], 0.4, label="p50")
    axes[1].bar([i + 0.2 for i in x], [r["ttft_p90_s"] for r in runs], 0.4, label="p90")
    axes[1].set_xticks(list(x), names)
    axes[1].set_ylabel("s")
    axes[1].set_title("time to first token")
    axes[1].legend()
    axes[2].bar(names, [r["prefix_hit_rate"] for r in runs], color="tab:green")
    axes[2].axhline(doc["meta"]["best_hit_rate"], color="k", ls="--", lw=1, label="best achievable")
    axes[2].set_title("prefix cache hit rate")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", labelrotation=30)
    w = doc["meta"]["workload"]
    fig.suptitle(f"{Path(doc['meta']['model']).name}, {doc['meta']['dtype']} on {doc['meta']['device']}: "
                 f"{w['systems']} system prompts x {w['users']} users x n={w['n']}, {w['new_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
