"""`python -m bench serve --http`: the serving workload over HTTP against the same work in process.

The same workload (`serve_workload.make_workload`) runs twice with the all-on engine: through
`EngineLoop` in this process, and as streaming `/v1/completions` requests (token-id prompts,
`ignore_eos`, the same seeds) from asyncio clients to a `forklm serve` child process with the
same engine options. Both report generated tokens/s, TTFT and inter-token latency; the HTTP
overhead is their ratio, plus the idle time to first token of one small request each way
(median of several), which isolates what HTTP adds to a request's latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from bench.workload import RunResult, Workload
from forklm.engine.loop import EngineLoop
from forklm.sampling.params import SamplingParams


def request_body(model: str, prompt: list[int], p: SamplingParams) -> dict:
    return {"model": model, "prompt": prompt, "n": p.n, "max_tokens": p.max_tokens, "temperature": p.temperature,
            "top_p": p.top_p, "seed": p.seed, "ignore_eos": p.ignore_eos, "stream": True, "logprobs": 0,
            "stream_options": {"include_usage": True}}


async def _stream_one(http, body: dict, on_chunk) -> int:
    """Sends one streaming request; calls on_chunk(choice_index, tokens) per choice per chunk;
    returns completion tokens from the usage chunk."""
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        usage = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for c in chunk["choices"]:
                on_chunk(c["index"], len(c["logprobs"]["tokens"]) if c.get("logprobs") else 1)
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
        return usage


def run_http(url: str, model: str, wl: Workload, progress) -> RunResult:
    import httpx

    res = RunResult("all-on over HTTP", {"http": url})

    async def main() -> None:
        limits = httpx.Limits(max_connections=len(wl.prompts) + 8, max_keepalive_connections=len(wl.prompts) + 8)
        async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
            t0 = time.perf_counter()

            async def one(i: int) -> None:
                await asyncio.sleep(max(0.0, t0 + wl.arrivals[i] - time.perf_counter()))
                submitted = time.perf_counter()
                last: dict[int, float] = {}
                first: list[float] = []

                def on_chunk(choice: int, tokens: int) -> None:
                    now = time.perf_counter()
                    if not first:
                        first.append(now)
                        res.ttft_s.append(now - submitted)
                    if choice in last:
                        res.itl_s.append(now - last[choice])
                        res.itl_s.extend([0.0] * (tokens - 1))
                    last[choice] = now
                    progress(tokens)

                body = request_body(model, wl.prompts[i], wl.params[i])
                tokens = await _stream_one(http, body, on_chunk)  # (no `x += await ...`: that races)
                res.generated_tokens += tokens

            await asyncio.gather(*(one(i) for i in range(len(wl.prompts))))
            res.makespan_s = time.perf_counter() - t0

    asyncio.run(main())
    return res


def idle_ttft_http(url: str, model: str, prompt: list[int], repeats: int = 7) -> float:
    """Median time to the first streamed token of one small request on an idle server."""
    import httpx

    async def main() -> list[float]:
        out = []
        async with httpx.AsyncClient(base_url=url, timeout=None) as http:
            for _ in range(repeats):
                t = time.perf_counter()
                seen: list[float] = []
                body = request_body(model, prompt, SamplingParams(n=1, max_tokens=2, seed=0))
                await _stream_one(http, body, lambda c, k: seen.append(time.perf_counter()) if not seen else None)
                out.append(seen[0] - t)
        return out

    return statistics.median(asyncio.run(main()))


def idle_ttft_engine(loop: EngineLoop, prompt: list[int], repeats: int = 7) -> float:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        stream = loop.submit(prompt, SamplingParams(n=1, max_tokens=2, seed=0))
        next(iter(stream))
        out.append(time.perf_counter() - t)
        stream.result()
    return statistics.median(out)


def server_args(args: argparse.Namespace, engine_args: dict) -> list[str]:
    return ["--dtype", args.dtype, "--device", args.device, "--block-size", str(engine_args["block_size"]),
            "--max-batch-tokens", str(engine_args["max_batch_tokens"]),
            "--memory-gib", str(engine_args["memory_budget"] / 2**30), "--max-requests", "100000"]


def overhead(in_process: dict, http: dict, ttft_engine: float, ttft_http: float) -> dict:
    return {
        "throughput_ratio": http["throughput_tok_s"] / in_process["throughput_tok_s"],
        "throughput_loss": 1 - http["throughput_tok_s"] / in_process["throughput_tok_s"],
        "ttft_p50_added_s": http["ttft_p50_s"] - in_process["ttft_p50_s"],
        "idle_ttft_in_process_s": ttft_engine,
        "idle_ttft_http_s": ttft_http,
        "idle_ttft_added_s": ttft_http - ttft_engine,
    }


def markdown_overhead(o: dict) -> str:
    return (f"HTTP vs in process: throughput x{o['throughput_ratio']:.3f} ({100 * o['throughput_loss']:+.1f}% lost), "
            f"TTFT p50 under load {1e3 * o['ttft_p50_added_s']:+.0f} ms; idle TTFT {1e3 * o['idle_ttft_http_s']:.1f} ms "
            f"over HTTP vs {1e3 * o['idle_ttft_in_process_s']:.1f} ms in process "
            f"({1e3 * o['idle_ttft_added_s']:+.1f} ms)")
