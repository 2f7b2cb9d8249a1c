"""A real `forklm serve` child process of the default model (default settings) over three measurements:

1. start: wall time from launching `forklm serve` until /health answers 200, for a first start (which
   may build the C++ kernels) and a second, warm one, each followed by the time of one small request;
2. time to first token (TTFT) of a short streamed completion (~20 prompt tokens, max_tokens 2): idle
   (median of --idle-repeats), and beside a long request (n=64 samples of a ~1,900-token prompt,
   max_tokens 64, EOS ignored, sent from a thread; the short one ~0.3 s after it, median of
   --beside-rounds rounds, each with a fresh long prompt, the server idle between rounds); the
   prefill chunk's time from /metrics' forklm_step_seconds over a long prompt prefilled alone;
   target: TTFT beside <= 2 x idle TTFT + one chunk's time;
3. resident memory over a soak: --rounds rounds of --requests random requests (completions and
   chat, streamed or not, n in {1, 2, 4}, max_tokens 2-8, shared system prompts, ~20% cancelled,
   at most --concurrency in flight), process_resident_memory_bytes read from /metrics once the
   server is idle after each round; target: every later round's within 2% of the first's.

    flock /tmp/forklm_bench.lock python -m bench.serve_soak              # the full run (~5 min on 2 cores)
    flock /tmp/forklm_bench.lock python -m bench serve_soak --rounds 1 --requests 20 --beside-rounds 1
                                                                         # a quick look

JSON goes to bench/results/serve_soak_<device>_<isa>_<date>.json (--out to change it).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.machine import machine_info
from forklm.server.process import ServerProcess

MODEL = "smollm2-135m"

# the request mix (also tests/test_server_load.py's): shared system prompts (the prefix cache reuses them), short user turns
SYSTEMS = [
    "# utils.py: helpers for parsing configuration files\nimport os\nimport re\nimport json\n\n"
    "def load(path):\n    with open(path) as f:\n        return json.load(f)\n\n",
    "class Matrix:\n    def __init__(self, rows):\n        self.rows = rows\n\n    def __mul__(self, other):\n"
    "        return Matrix([[sum(a * b for a, b in zip(r, c)) for c in zip(*other.rows)] for r in self.rows])\n\n",
    "You are a careful code reviewer. Point out bugs, then suggest a fix in one sentence.\n\n",
]
USERS = ["def parse_line(line):", "def save(obj, path):", "    def transpose(self):", "def merge(a, b):",
         "Review: x = [i for i in range(10) if i % 2]", "def retry(fn, times=3):"]


# ---------------------------------------------------------------------------------------------- helpers
def wait_idle(server: ServerProcess, timeout: float = 120.0) -> dict:
    """Polls /metrics until nothing runs, waits or is in flight and no KV block is in use (the server
    tests wait with it too); returns the last sample, RuntimeError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["forklm_kv_blocks_in_use"] == 0 and m["forklm_requests_running"] == 0
                and m["forklm_requests_waiting"] == 0 and m["forklm_requests_in_flight"] == 0):
            return m
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server is not idle after {timeout} s: {m}")
        time.sleep(0.1)


def short_prompt(tag: str) -> str:
    """About 20 tokens, distinct from its first token on (nothing for the prefix cache)."""
    return f"# {tag}\ndef add(a, b):\n    return a + b\n\ndef mul(a, b):\n"


def code_text() -> str:
    """Real Python source, enough for a few thousand tokens."""
    import argparse as a, json.decoder as d, textwrap as t

    return "".join(inspect.getsource(m) for m in (a, d, t))


def long_prompt(tag: str, chars: int) -> str:
    return f"# {tag}\n" + code_text()[:chars]


def stream_ttft(http, body: dict, path: str = "/v1/completions", on_first=None) -> tuple[float, int]:
    """Sends a streamed request; returns (seconds to the first event with content, events seen).
    Reads to the end of the stream; lines after the first are not parsed."""
    t0 = time.perf_counter()
    first = None
    events = 0
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events += 1
            if first is None:
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{path}: error event {chunk}")
                choices = chunk.get("choices") or []
                if any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices):
                    first = time.perf_counter() - t0
                    if on_first is not None:
                        on_first()
    if first is None:
        raise RuntimeError(f"{path}: the stream ended without content ({events} events)")
    return first, events


def prompt_tokens(http, prompt: str) -> int:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens"]


# ---------------------------------------------------------------------------------------------- 1. start
def timed_start(model: str, timeout: float) -> tuple[ServerProcess, float, float]:
    """A server, the seconds until its /health answered (ServerProcess polls every 0.5 s), and the
    seconds of its first small request (kernels built or loaded on first use show here)."""
    import httpx

    t0 = time.perf_counter()
    server = ServerProcess(model=model, timeout=timeout)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", timeout=timeout,
                   json={"model": model, "prompt": short_prompt("warm-up"), "max_tokens": 2, "temperature": 0})
    r.raise_for_status()
    return server, start_s, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------- 2. TTFT
def calibrate_long(http, target: int) -> tuple[int, int]:
    """Characters of code text for a prompt of about `target` tokens, and its token count."""
    chars = target * 3
    for k in range(3):
        tokens = prompt_tokens(http, long_prompt(f"calibration {k}", chars))
        if abs(tokens - target) <= 0.02 * target:
            break
        chars = int(chars * target / tokens)
    return chars, prompt_tokens(http, long_prompt("calibration check", chars))


def prefill_alone(server: ServerProcess, http, chars: int, tokens: int, max_batch_tokens: int, repeats: int) -> dict:
    """A fresh long prompt prefilled alone (max_tokens 1, streamed), `repeats` times: the engine's step
    time from forklm_step_seconds (sum / count over the request: its prefill chunks), and the wall
    TTFT divided by the number of chunks."""
    chunks = math.ceil(tokens / max_batch_tokens)
    runs = []
    for k in range(repeats):
        before = wait_idle(server)
        ttft, _ = stream_ttft(http, {"model": MODEL, "prompt": long_prompt(f"prefill alone {k}", chars),
                                     "max_tokens": 1, "temperature": 0})
        after = wait_idle(server)
        steps = after["forklm_step_seconds_count"] - before["forklm_step_seconds_count"]
        step_s = (after["forklm_step_seconds_sum"] - before["forklm_step_seconds_sum"]) / max(steps, 1)
        runs.append({"ttft_s": ttft, "steps": steps, "step_mean_s": step_s, "wall_per_chunk_s": ttft / chunks})
    return {"prompt_tokens": tokens, "max_batch_tokens": max_batch_tokens, "chunks": chunks, "runs": runs,
            "chunk_s": statistics.median(r["step_mean_s"] for r in runs),
            "wall_per_chunk_s": statistics.median(r["wall_per_chunk_s"] for r in runs),
            "prefill_s": statistics.median(r["ttft_s"] for r in runs)}


def idle_ttft(server: ServerProcess, http, repeats: int) -> dict:
    wait_idle(server)
    stream_ttft(http, {"model": MODEL, "prompt": short_prompt("idle warm-up"), "max_tokens": 2, "temperature": 0})
    runs = []
    for k in range(repeats):
        wait_idle(server)
        runs.append(stream_ttft(http, {"model": MODEL, "prompt": short_prompt(f"idle {k}"), "max_tokens": 2,
                                       "temperature": 0})[0])
    return {"runs_s": runs, "median_s": statistics.median(runs)}


def ttft_beside_long(server: ServerProcess, http, chars: int, args: argparse.Namespace) -> dict:
    """Rounds of: a fresh long request (n samples, streamed from a thread), the short one `delay` s
    after it was sent; times relative to the long request's send."""
    import httpx

    rounds = []
    for k in range(args.beside_rounds):
        wait_idle(server)
        long_body = {"model": MODEL, "prompt": long_prompt(f"beside round {k}", chars), "n": args.long_n,
                     "max_tokens": args.long_max_tokens, "ignore_eos": True, "temperature": 1.0, "seed": k}
        marks: dict[str, float] = {}
        failure: list[BaseException] = []

        def long_request() -> None:
            try:
                with httpx.Client(base_url=server.url, timeout=None) as c:
                    stream_ttft(c, long_body, on_first=lambda: marks.setdefault("long_first", time.perf_counter()))
                marks["long_done"] = time.perf_counter()
            except BaseException as e:  # noqa: BLE001 - reported below
                failure.append(e)

        thread = threading.Thread(target=long_request)
        t0 = time.perf_counter()
        thread.start()
        time.sleep(max(0.0, t0 + args.short_delay - time.perf_counter()))
        sent = time.perf_counter() - t0
        ttft, _ = stream_ttft(http, {"model": MODEL, "prompt": short_prompt(f"beside {k}"), "max_tokens": 2,
                                     "temperature": 0})
        thread.join()
        if failure:
            raise RuntimeError(f"the long request failed: {failure[0]!r}")
        long_first = marks["long_first"] - t0
        rounds.append({"short_sent_s": sent, "short_ttft_s": ttft, "short_first_token_s": sent + ttft,
                       "long_first_token_s": long_first, "long_done_s": marks["long_done"] - t0,
                       "short_sent_during_long_prefill": sent < long_first})
        print(f"  beside round {k}: short sent at {sent:.2f} s, its TTFT {ttft:.3f} s; the long one's first token "
              f"at {long_first:.2f} s, done at {rounds[-1]['long_done_s']:.1f} s", flush=True)
    return {"rounds": rounds, "median_s": statistics.median(r["short_ttft_s"] for r in rounds)}


# ---------------------------------------------------------------------------------------------- 3. soak
async def one_request(http, rng: random.Random, k: int) -> str:
    """One random request of the soak's mix (tests/test_server_load.py sends it too); returns "ok",
    "cancelled" (planned) or "error: ..." (anything else, counted instead of raised)."""
    chat = rng.random() < 0.3
    stream = rng.random() < 0.5
    cancel = rng.random() < 0.2
    n = rng.choice([1, 2, 4])
    system, user = rng.choice(SYSTEMS), rng.choice(USERS)
    body = {"model": MODEL, "n": n, "max_tokens": rng.randint(2, 8), "temperature": rng.choice([0, 0.7, 1.0]),
            "seed": k, "stream": stream}
    if chat:
        body["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    else:
        body["prompt"] = system + user
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        if stream:
            async with http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    return f"error: {r.status_code}"
                finished = set()
                async for line in r.aiter_lines():
                    if cancel:
                        return "cancelled"  # leaving the block closes the connection mid-stream
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        return "error: error event"
                    finished |= {c["index"] for c in chunk["choices"] if c.get("finish_reason")}
                return "ok" if finished == set(range(n)) else "error: unfinished choices"
        task = asyncio.ensure_future(http.post(path, json=body))
        if cancel:
            await asyncio.sleep(rng.uniform(0.0, 1.0))
            if not task.done():
                task.cancel()  # the client gives up: its connection closes
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                return "cancelled"
        r = await task
        if r.status_code != 200:
            return f"error: {r.status_code}"
        choices = r.json()["choices"]
        ok = len(choices) == n and all(c["finish_reason"] in ("stop", "length") for c in choices)
        return "ok" if ok else "error: bad choices"
    except Exception as e:  # noqa: BLE001 - a broken connection, a timeout: counted
        return f"error: {type(e).__name__}"


async def soak_round(url: str, count: int, concurrency: int, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        async def gated(k: int, r: random.Random) -> str:
            async with gate:
                return await one_request(http, r, k)

        results = await asyncio.gather(*(gated(k, random.Random(rng.random())) for k in range(count)))
    return {r: results.count(r) for r in sorted(set(results))}


def soak(server: ServerProcess, args: argparse.Namespace) -> dict:
    before = wait_idle(server)
    rounds = []
    for k in range(args.rounds):
        t0 = time.perf_counter()
        outcomes = asyncio.run(soak_round(server.url, args.requests, args.concurrency, seed=1000 + k))
        seconds = time.perf_counter() - t0
        wait_idle(server)
        time.sleep(args.settle_s)
        m = wait_idle(server)
        rounds.append({"seconds": seconds, "outcomes": outcomes, "rss_bytes": m["process_resident_memory_bytes"],
                       "kv_blocks_cached": m["forklm_kv_blocks_cached"],
                       "prefix_cache_hit_rate": m["forklm_prefix_cache_hit_rate"],
                       "steps": m["forklm_step_seconds_count"]})
        print(f"  soak round {k + 1}: {args.requests} requests in {seconds:.0f} s {outcomes}; "
              f"RSS {m['process_resident_memory_bytes'] / 2**20:.1f} MiB", flush=True)
    first = rounds[0]["rss_bytes"]
    ratios = [r["rss_bytes"] / first for r in rounds[1:]]
    return {"requests_per_round": args.requests, "concurrency": args.concurrency, "settle_s": args.settle_s,
            "rss_before_bytes": before["process_resident_memory_bytes"],
            "kv_pool_bytes": before["forklm_kv_pool_bytes"], "kv_blocks_total": before["forklm_kv_blocks_total"],
            "rounds": rounds, "rss_ratios_to_round1": ratios,
            "target": "every later round's RSS within 2% of round 1's",
            "target_met": all(abs(r - 1) <= 0.02 for r in ratios),
            "errors": sum(v for r in rounds for o, v in r["outcomes"].items() if o.startswith("error"))}


# ---------------------------------------------------------------------------------------------- the run
def git(*cmd: str) -> str:
    try:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def command_line() -> str:
    """The invocation: `python -m bench.serve_soak ...`, or `python -m bench serve_soak ...` (bench/cli.py
    runs a study with sys.argv[0] set to its words)."""
    head = sys.argv[0] if " " in sys.argv[0] else "python -m bench.serve_soak"
    return " ".join([head, *sys.argv[1:]])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve_soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=MODEL, help=f"the served model (default: {MODEL}; the rest default settings)")
    p.add_argument("--start-timeout", type=float, default=1200.0,
                   help="seconds a start may take (the first may build kernels) (default: 1200)")
    p.add_argument("--idle-repeats", type=int, default=5, help="idle TTFT samples (default: 5)")
    p.add_argument("--prefill-repeats", type=int, default=3, help="long prompts prefilled alone (default: 3)")
    p.add_argument("--beside-rounds", type=int, default=3, help="rounds of a short request beside a long one (default: 3)")
    p.add_argument("--long-tokens", type=int, default=1900, help="the long prompt's tokens (default: 1900)")
    p.add_argument("--long-n", type=int, default=64, help="the long request's samples (default: 64)")
    p.add_argument("--long-max-tokens", type=int, default=64, help="the long request's max_tokens (default: 64)")
    p.add_argument("--short-delay", type=float, default=0.3, help="seconds from the long request to the short one (default: 0.3)")
    p.add_argument("--max-batch-tokens", type=int, default=512,
                   help="the server's --max-batch-tokens (its default; the prefill chunk) (default: 512)")
    p.add_argument("--rounds", type=int, default=3, help="soak rounds (default: 3)")
    p.add_argument("--requests", type=int, default=600, help="requests per soak round (default: 600)")
    p.add_argument("--concurrency", type=int, default=32, help="soak requests in flight at most (default: 32)")
    p.add_argument("--settle-s", type=float, default=1.0, help="seconds idle before RSS is read (default: 1)")
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/serve_soak_<device>_<isa>_<date>.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    import httpx

    args = build_parser().parse_args(argv)
    machine = machine_info()
    isa = "avx512" if machine["avx512"] else "avx2" if machine["avx2"] else machine["machine"]
    date = time.strftime("%Y-%m-%d")
    out = Path(args.out or f"bench/results/serve_soak_cpu_{isa}_{date}.json")
    load_before = os.getloadavg()

    print("starting forklm serve (first start)", flush=True)
    first, first_start, first_request = timed_start(args.model, args.start_timeout)
    first.stop()
    print(f"  first start {first_start:.2f} s, its first request {first_request:.2f} s", flush=True)
    server, warm_start, warm_request = timed_start(args.model, args.start_timeout)
    print(f"  warm start {warm_start:.2f} s, its first request {warm_request:.2f} s", flush=True)
    try:
        with httpx.Client(base_url=server.url, timeout=None) as http:
            chars, long_tokens = calibrate_long(http, args.long_tokens)
            short_tokens = prompt_tokens(http, short_prompt("idle 0"))
            prefill = prefill_alone(server, http, chars, long_tokens, args.max_batch_tokens, args.prefill_repeats)
            print(f"  long prompt {long_tokens} tokens prefilled alone in {prefill['prefill_s']:.3f} s, "
                  f"{prefill['chunks']} chunks, step {prefill['chunk_s']:.3f} s", flush=True)
            idle = idle_ttft(server, http, args.idle_repeats)
            print(f"  idle TTFT {idle['median_s'] * 1000:.1f} ms ({short_tokens} prompt tokens)", flush=True)
            beside = ttft_beside_long(server, http, chars, args)
        bound = 2 * idle["median_s"] + prefill["chunk_s"]
        ttft = {"short_prompt_tokens": short_tokens, "short_max_tokens": 2, "idle": idle,
                "long": {"prompt_tokens": long_tokens, "n": args.long_n, "max_tokens": args.long_max_tokens,
                         "ignore_eos": True, "short_delay_s": args.short_delay},
                "prefill_alone": prefill, "beside_long": beside,
                "target": "TTFT beside the long prefill <= 2 x idle TTFT + one prefill chunk's time",
                "bound_s": bound, "target_met": beside["median_s"] <= bound}
        soaked = soak(server, args)
        alive = server.proc.poll() is None
    finally:
        server.stop()
    doc = {
        "what": "forklm serve of the default model with default settings: warm start, a short request's TTFT "
                "beside a long prefill, resident memory over soak rounds",
        "meta": {"command": command_line(), "server_command": " ".join(["python", *server.proc.args[1:]]),
                 "model": args.model, **machine, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "git_commit": git("rev-parse", "HEAD"),
                 "git_dirty_forklm": git("status", "--porcelain", "--", "forklm").splitlines(),
                 "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "start": {"first_start_s": first_start, "first_request_after_first_start_s": first_request,
                  "warm_start_s": warm_start, "first_request_after_warm_start_s": warm_request,
                  "health_poll_interval_s": 0.5},
        "ttft": ttft,
        "soak": soaked,
        "server_alive_at_end": alive,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(summary(doc))
    print(f"wrote {out}")
    return 0


def summary(doc: dict) -> str:
    s, t, k = doc["start"], doc["ttft"], doc["soak"]
    rss = ", ".join(f"{r['rss_bytes'] / 2**20:.1f}" for r in k["rounds"])
    ratios = ", ".join(f"{x:.4f}" for x in k["rss_ratios_to_round1"])
    return "\n".join([
        f"{doc['meta']['cpu']} (avx2 {doc['meta']['avx2']}, avx512 {doc['meta']['avx512']}), "
        f"{doc['meta']['threads']} threads, commit {doc['meta']['git_commit'][:7]}",
        f"start: first {s['first_start_s']:.2f} s, warm {s['warm_start_s']:.2f} s (to /health 200; 0.5 s polling)",
        f"TTFT idle {t['idle']['median_s'] * 1000:.1f} ms; beside the long prefill {t['beside_long']['median_s'] * 1000:.1f} ms; "
        f"chunk {t['prefill_alone']['chunk_s'] * 1000:.1f} ms; bound 2 x idle + chunk = {t['bound_s'] * 1000:.1f} ms: "
        f"{'met' if t['target_met'] else 'NOT met'}",
        f"RSS after rounds (MiB): {rss}; ratios to round 1: {ratios}: {'met' if k['target_met'] else 'NOT met'} "
        f"(within 2%); errors {k['errors']}; server alive {doc['server_alive_at_end']}",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
