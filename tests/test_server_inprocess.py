"""The server's request bookkeeping and metrics in process (`_Server` over a real engine loop),
where a consumer or a scrape can be watched directly."""

import asyncio
import json
import sys
import time

import pytest

MODEL = "smollm2-135m"


@pytest.fixture()
def server(smollm2_f32):
    from forklm.server.app import ServerConfig, _Server

    srv = _Server(smollm2_f32, ServerConfig(model_name=MODEL, engine_options={"num_blocks": 128}))
    yield srv
    srv.loop.close()


def jobs_of(srv, body: dict):
    from forklm.server.protocol import CompletionBody, parse_body

    return srv.jobs_for(parse_body(CompletionBody, {"model": MODEL, **body}))


def wait_in_flight(srv, value: int, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while srv._in_flight != value and time.monotonic() < end:
        time.sleep(0.05)
    assert srv._in_flight == value
    assert srv.metrics.registry.get_sample_value("forklm_requests_in_flight") == value


def test_a_consumer_that_cannot_take_events_frees_its_slot(server):
    """A stream's asyncio loop closes (its consumer went away) while the engine still produces
    tokens: delivering them raises. The request is cancelled and its in-flight slot returns; the
    server keeps counting right for the next request."""
    jobs = jobs_of(server, {"prompt": ["def f(x):", "import os"], "max_tokens": 400, "ignore_eos": True})
    server.submit(jobs, stream_tokens=True, request_id="cmpl-gone")
    assert server._in_flight == 2

    async def first_batch():
        async for batch in jobs[0].stream.batches():
            return batch

    asyncio.run(first_batch())  # attached, then its event loop is closed
    server.cancel(jobs[1:])
    wait_in_flight(server, 0)
    assert jobs[0].stream.done and jobs[0].stream.output.samples[0].finish_reason == "cancelled"
    jobs = jobs_of(server, {"prompt": "def f(x):", "max_tokens": 2})
    server.submit(jobs, stream_tokens=False, request_id="cmpl-next")
    assert len(jobs[0].stream.result(60).samples) == 1
    wait_in_flight(server, 0)


def test_a_scrape_never_runs_engine_code(server):
    """/metrics is rendered from numbers the engine thread copied after its last step: a scrape
    calls nothing in the engine, the KV pool or the cache (it cannot race the engine thread, and
    costs the same for any pool size), yet shows the engine's state."""
    jobs = jobs_of(server, {"prompt": "x = [i * i for i in range(100)]\n" * 4, "max_tokens": 3})
    server.submit(jobs, stream_tokens=False, request_id="cmpl-m")
    jobs[0].stream.result(60)
    wait_in_flight(server, 0)
    time.sleep(0.5)  # the loop thread copies the numbers just after the step that ended the request

    called = set()

    def profile(frame, event, arg):
        if event == "call":
            called.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        text = server.metrics.render().decode()
    finally:
        sys.setprofile(None)
    engine_code = sorted(f for f in called if any(f"forklm/{d}/" in f for d in ("engine", "cache", "attention")))
    assert engine_code == []
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["forklm_kv_blocks_total"]) == 128
    assert float(values["forklm_kv_blocks_in_use"]) == 0 and float(values["forklm_requests_running"]) == 0
    assert float(values["forklm_kv_blocks_cached"]) > 0  # the prompt's blocks stay in the prefix cache
    assert float(values["forklm_step_seconds_count"]) >= 3


def test_a_stream_whose_client_left_before_it_started_is_cancelled(smollm2_f32):
    """An ASGI 2.4 server raises on a send to a closed connection: Starlette then fails the
    response at its first message, before it starts the body's generator, so the generator's own
    cleanup never runs. The samples must stop anyway (driven here at the ASGI interface)."""
    from forklm.server.app import ServerConfig, create_app

    app = create_app(smollm2_f32, ServerConfig(model_name=MODEL, engine_options={"num_blocks": 128}))
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 1500, "stream": True,
                       "ignore_eos": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def main():
        async with app.router.lifespan_context(app):
            srv = app.state.server
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive():
                return messages.pop() if messages else {"type": "http.disconnect"}

            async def send(message):
                raise OSError("the client is gone")

            await app(scope, receive, send)
            end = time.monotonic() + 15
            while srv._in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)
            return srv._in_flight, srv.engine.has_unfinished()

    assert asyncio.run(main()) == (0, False)
