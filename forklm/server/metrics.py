"""Prometheus metrics of one server (its own registry, so several servers can live in one process).

A scrape never reads the engine: the engine loop's per-step hook (`on_step`, on the engine
thread) copies a few O(1) numbers of the engine into plain gauges, so a scrape costs the same
whatever the pool's size, never races the engine thread, and may see a state one step old. The hook's
gauges are set under one lock that a scrape also takes, so a scrape sees one step's numbers together
(never a step's running count beside the previous step's block count).
Counters and histograms are fed by the request handlers and by the same hook.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from forklm.engine.engine import Engine

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServerMetrics:
    def __init__(self, engine: Engine) -> None:
        self.registry = reg = CollectorRegistry()
        self._step_lock = threading.Lock()  # on_step's gauges against render: one step's numbers together
        ProcessCollector(registry=reg)  # process_resident_memory_bytes and friends
        self.running = Gauge("forklm_requests_running", "Requests being prefilled or decoded", registry=reg)
        self.waiting = Gauge("forklm_requests_waiting", "Requests queued in the engine, not yet admitted",
                             registry=reg)
        self.in_flight = Gauge(
            "forklm_requests_in_flight", "Engine requests submitted over HTTP and not finished", registry=reg
        )
        self.blocks_in_use = Gauge("forklm_kv_blocks_in_use", "KV cache blocks held by running sequences",
                                   registry=reg)
        self.blocks_cached = Gauge("forklm_kv_blocks_cached", "KV cache blocks held only by the prefix cache",
                                   registry=reg)
        Gauge("forklm_kv_blocks_total", "KV cache blocks in the pool", registry=reg).set(engine.pool.num_blocks)
        Gauge("forklm_kv_pool_bytes", "Bytes of the KV cache pool (committed at start)", registry=reg).set(
            engine.kv.nbytes()
        )
        self.hit_rate = Gauge(
            "forklm_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens admitted",
            registry=reg,
        )
        self.prompt_tokens = Counter("forklm_prompt_tokens", "Prompt tokens of finished requests", registry=reg)
        self.cached_prompt_tokens = Counter(
            "forklm_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=reg
        )
        self.generation_tokens = Counter("forklm_generation_tokens", "Tokens generated", registry=reg)
        self.requests = Counter(
            "forklm_requests", "Finished HTTP requests by endpoint and status code", ["endpoint", "status"],
            registry=reg,
        )
        self.ttft = Histogram(
            "forklm_time_to_first_token_seconds", "Arrival to first generated token", buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "forklm_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=reg
        )
        self.step = Histogram(
            "forklm_step_seconds", "Wall time of one engine step (schedule, forward, sample)", buckets=_STEP_BUCKETS,
            registry=reg,
        )

        self.spec = None
        if engine.speculator is not None:  # cumulative engine counters, copied each step
            names = {
                "draft_tokens": "Draft tokens proposed and verified",
                "accepted_tokens": "Draft tokens accepted by verification",
                "emitted_tokens": "Tokens emitted by steps that verified drafts (accepted plus one per drafted row)",
                "spec_steps": "Engine steps that verified drafts",
                "off_steps": "Engine steps where the cost rule (or the token budget) turned drafting off",
                "draft_failures": "Draft-model forwards that failed (those steps decoded without drafts)",
                "draft_s": "Seconds spent drafting",
                "verify_s": "Seconds spent in verification draws and acceptance (the forward not counted)",
            }
            self.spec = {k: Gauge("forklm_spec_" + (k[:-2] + "_seconds" if k.endswith("_s") else k), h, registry=reg)
                         for k, h in names.items()}
            self.spec_acceptance = Gauge("forklm_spec_acceptance_rate", "Accepted / drafted tokens", registry=reg)
            self.spec_tokens_per_step = Gauge(
                "forklm_spec_tokens_per_drafted_row", "Tokens emitted per drafted row per step", registry=reg)

    def on_step(self, engine: Engine, seconds: float) -> None:
        """After each step, on the engine thread: O(1) reads (list lengths, the pool's counters)."""
        with self._step_lock:
            self.step.observe(seconds)
            self.running.set(len(engine.active))
            self.waiting.set(len(engine.waiting))
            self.blocks_in_use.set(engine.pool.num_in_use)
            self.blocks_cached.set(engine.pool.num_cached)
            self.hit_rate.set(engine.metrics.prefix_hit_rate)
            if self.spec is not None:
                m = engine.speculator.metrics
                for k, g in self.spec.items():
                    g.set(getattr(m, k))
                self.spec_acceptance.set(m.acceptance_rate)
                self.spec_tokens_per_step.set(m.tokens_per_draft)

    def finished(self, output) -> None:  # a SampleOutput
        st = output.stats
        self.prompt_tokens.inc(st.prompt_tokens)
        self.cached_prompt_tokens.inc(st.cached_prompt_tokens)
        self.generation_tokens.inc(st.generated_tokens)

    def render(self) -> bytes:
        with self._step_lock:
            return generate_latest(self.registry)
