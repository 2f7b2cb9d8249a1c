"""Does scraping /metrics slow generation? Generation time of one batch of requests against a
`forklm serve` child process, alone and while unthrottled scrapers fetch /metrics as fast as
the server answers.

    python -m bench.metrics_scrape                          # 8 requests of ~700 prompt tokens, 4 scrapers
    python -m bench.metrics_scrape --requests 2 --max-tokens 8 --repeats 1   # a quick look

Each repeat runs the batch alone, then with scrapers; the fastest run of each is compared. The
scrapers are threads of a separate process on raw keep-alive sockets (little client CPU: on a
small machine the clients would otherwise take the cores the server needs). JSON goes to
bench/results/metrics_scrape_<device>.json (--out to change it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from forklm.server.process import ServerProcess

MODEL = "smollm2-135m"


def prompt(i: int, words: int) -> str:
    """A distinct prompt per request (nothing for the prefix cache to share), about 1.3 tokens a word."""
    body = " ".join(f"item{(i * 7919 + k) % 1000} = value_{k % 37}" for k in range(words // 3))
    return f"# request {i}\n{body}\n"


def run_batch(url: str, prompts: list[str], max_tokens: int) -> dict:
    import httpx

    def one(p: str) -> dict:
        body = {"model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=None)
        r.raise_for_status()
        return r.json()["usage"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        usages = list(pool.map(one, prompts))
    return {"seconds": time.perf_counter() - t0, "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
            "completion_tokens": sum(u["completion_tokens"] for u in usages)}


def _scrape(port: int, stop, counts, k: int) -> None:
    """Fetches /metrics over one keep-alive connection until `stop` is set."""
    request = f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = b""
        while not stop.is_set():
            s.sendall(request)
            while b"\r\n\r\n" not in buf:
                buf += s.recv(65536)
            head, buf = buf.split(b"\r\n\r\n", 1)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(buf) < length:
                buf += s.recv(65536)
            buf = buf[length:]
            counts[k] += 1


def _scraper_process(port: int, scrapers: int, stop, counts) -> None:
    threads = [threading.Thread(target=_scrape, args=(port, stop, counts, k)) for k in range(scrapers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.metrics_scrape", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests per batch (default: 8)")
    ap.add_argument("--prompt-words", type=int, default=540, help="words per prompt, ~700 tokens (default: 540)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: 64)")
    ap.add_argument("--scrapers", type=int, default=4, help="unthrottled /metrics scrapers (default: 4)")
    ap.add_argument("--repeats", type=int, default=2, help="batches alone and scraped, fastest kept (default: 2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="JSON path (default: bench/results/metrics_scrape_<device>.json)")
    args = ap.parse_args(argv)

    prompts = [prompt(i, args.prompt_words) for i in range(args.requests)]
    server = ServerProcess("--dtype", args.dtype, "--device", args.device, "--memory-gib", "1")
    try:
        def batch(tag: str) -> dict:  # distinct prompts in every batch: no prefix cache hits
            return run_batch(server.url, [f"# batch {tag}\n{p}" for p in prompts], args.max_tokens)

        batch("warm-up")
        alone, scraped, scrapes = [], [], []
        for r in range(args.repeats):
            alone.append(batch(f"alone {r}"))
            stop = multiprocessing.Event()
            counts = multiprocessing.Array("l", args.scrapers)
            proc = multiprocessing.Process(target=_scraper_process, args=(server.port, args.scrapers, stop, counts))
            proc.start()
            time.sleep(1.0)  # scrapers at full speed before the batch starts
            before = sum(counts)
            scraped.append(batch(f"scraped {r}"))
            scrapes.append((sum(counts) - before) / scraped[-1]["seconds"])
            stop.set()
            proc.join(30)
            print(f"repeat {r}: alone {alone[-1]['seconds']:.2f} s, with {args.scrapers} scrapers "
                  f"{scraped[-1]['seconds']:.2f} s ({scrapes[-1]:.0f} scrapes/s)", flush=True)
    finally:
        server.stop()
    best_alone = min(x["seconds"] for x in alone)
    best_scraped = min(x["seconds"] for x in scraped)
    result = {
        "what": "generation time of one batch of requests alone and while unthrottled scrapers fetch /metrics",
        "machine": platform.processor() or platform.machine(), "device": args.device, "dtype": args.dtype,
        "model": MODEL, "requests": args.requests, "prompt_tokens_per_request": alone[0]["prompt_tokens"] // args.requests,
        "max_tokens": args.max_tokens, "scrapers": args.scrapers, "repeats": args.repeats,
        "alone_s": [x["seconds"] for x in alone], "scraped_s": [x["seconds"] for x in scraped],
        "scrapes_per_s": scrapes, "slowdown": best_scraped / best_alone,
    }
    out = Path(args.out or f"bench/results/metrics_scrape_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"fastest alone {best_alone:.2f} s, with scrapers {best_scraped:.2f} s: x{result['slowdown']:.3f} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
