"""Disconnects and load against a real `forklm serve`: cancelled work releases its KV blocks, a few
hundred concurrent requests with shared prefixes and random cancellations are all answered or
cancelled, none lost, no block leaked, memory steady."""

import asyncio
import json
import random
import time

import httpx
import pytest
from test_server import CODE, MODEL, wait_idle


def auth(server) -> dict:
    return {"Authorization": f"Bearer {server.api_key}"}


def test_disconnect_mid_stream_releases_blocks(forklm_server):
    wait_idle(forklm_server)
    body = {"model": MODEL, "prompt": CODE, "n": 4, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=forklm_server.url, headers=auth(forklm_server), timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 3:
                        break
            # /metrics may show a state one step old (the gauges are copied after a step, its tokens are
            # streamed during it): the first step's 4 tokens can arrive before its gauges are set
            deadline = time.monotonic() + 5
            while True:
                busy = forklm_server.metrics()
                if busy["forklm_requests_running"] == 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
            assert busy["forklm_kv_blocks_in_use"] > 0 and busy["forklm_requests_running"] == 1
        closed_at = time.monotonic()
        idle = wait_idle(forklm_server, timeout=10)
    assert time.monotonic() - closed_at < 10
    # the engine noticed within a few steps (the disconnect travels socket -> uvicorn -> loop thread)
    assert idle["forklm_step_seconds_count"] - busy["forklm_step_seconds_count"] < 20


def test_disconnect_while_waiting_for_a_whole_response(forklm_server):
    wait_idle(forklm_server)
    body = {"model": MODEL, "prompt": CODE, "n": 2, "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(forklm_server.url + "/v1/completions", json=body, headers=auth(forklm_server), timeout=2.0)
    wait_idle(forklm_server, timeout=10)


SYSTEMS = [
    "# utils.py: helpers for parsing configuration files\nimport os\nimport re\nimport json\n\n"
    "def load(path):\n    with open(path) as f:\n        return json.load(f)\n\n",
    "class Matrix:\n    def __init__(self, rows):\n        self.rows = rows\n\n    def __mul__(self, other):\n"
    "        return Matrix([[sum(a * b for a, b in zip(r, c)) for c in zip(*other.rows)] for r in self.rows])\n\n",
    "You are a careful code reviewer. Point out bugs, then suggest a fix in one sentence.\n\n",
]
USERS = ["def parse_line(line):", "def save(obj, path):", "    def transpose(self):", "def merge(a, b):",
         "Review: x = [i for i in range(10) if i % 2]", "def retry(fn, times=3):"]


async def one_request(http: httpx.AsyncClient, rng: random.Random, k: int) -> str:
    """Sends one random request; returns "ok" or "cancelled" (planned), raises on anything else."""
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
    if stream:
        async with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200, await r.aread()
            finished = set()
            async for line in r.aiter_lines():
                if cancel:
                    return "cancelled"  # leaving the block closes the connection mid-stream
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                finished |= {c["index"] for c in chunk["choices"] if c.get("finish_reason")}
            assert finished == set(range(n)), (finished, n)
            return "ok"
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
    assert r.status_code == 200, r.text
    doc = r.json()
    assert len(doc["choices"]) == n
    assert all(c["finish_reason"] in ("stop", "length") for c in doc["choices"])
    return "ok"


async def load_round(server, count: int, seed: int) -> dict:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=server.url, headers=auth(server), timeout=300, limits=limits) as http:
        results = await asyncio.gather(*(one_request(http, random.Random(rng.random()), k) for k in range(count)))
    return {r: results.count(r) for r in set(results)}


def test_load_hundreds_of_concurrent_requests_with_cancellations(forklm_server):
    wait_idle(forklm_server)
    t0 = time.monotonic()
    first = asyncio.run(load_round(forklm_server, 300, seed=1))
    after_first = wait_idle(forklm_server)
    second = asyncio.run(load_round(forklm_server, 300, seed=2))
    after_second = wait_idle(forklm_server)
    elapsed = time.monotonic() - t0
    for outcome in (first, second):
        assert sum(outcome.values()) == 300  # every request answered or cancelled, none lost
        assert outcome.get("ok", 0) > 150 and outcome.get("cancelled", 0) > 10
    assert elapsed < 600
    assert after_second["forklm_kv_blocks_in_use"] == 0
    # The KV pool is committed at start, so resident memory only moves with real allocations.
    assert after_first["process_resident_memory_bytes"] > after_first["forklm_kv_pool_bytes"]
    growth = after_second["process_resident_memory_bytes"] - after_first["process_resident_memory_bytes"]
    print(f"load rounds: {first} {second}; {elapsed:.0f} s; resident memory growth {growth / 2**20:.1f} MiB")
    assert growth < 100 * 2**20, f"server memory grew by {growth / 2**20:.0f} MiB over a second round"
    assert after_second["forklm_prefix_cache_hit_rate"] > 0.3  # the shared system prompts were reused
    assert forklm_server.proc.poll() is None
