"""Edges a hostile or careless client finds, against a real `forklm serve` (issue 13): clients that
leave early, bodies that never end, values too large to echo, limits that must be reachable."""

import json
import socket
import time

import httpx
import openai
import pytest
from test_server import CHAT, CODE, MODEL, ok, raw_post, wait_idle


def send_raw(server, request: bytes) -> None:
    """Sends bytes on a fresh connection and closes it at once, without reading an answer."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(request)


def post_head(server, path: str, length: int | None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.api_key}\r\n"
            f"Content-Type: application/json\r\n{size}\r\n\r\n").encode()


def log_since(server, start: int) -> str:
    time.sleep(0.5)  # let the server write what it has to say
    return server.read_log()[start:]


def test_disconnect_while_sending_the_body_is_quiet(forklm_server):
    start = len(forklm_server.read_log())
    body = json.dumps({"model": MODEL, "prompt": CODE}).encode()
    send_raw(forklm_server, post_head(forklm_server, "/v1/completions", 10_000) + body[:20])
    send_raw(forklm_server, post_head(forklm_server, "/v1/chat/completions", None) + b"10\r\n{\"model\": \"smol")
    ok(forklm_server)
    log = log_since(forklm_server, start)
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


@pytest.mark.parametrize("value, code", [(2.0, 200), (2.01, 400), (1e9, 400)])
def test_temperature_is_at_most_openais_2(forklm_server, value, code):
    client = forklm_server.client()
    for call in (lambda: client.completions.create(model=MODEL, prompt=CODE, max_tokens=2, temperature=value),
                 lambda: client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                                        temperature=value)):
        if code == 200:
            assert len(call().choices) == 1
        else:
            with pytest.raises(openai.BadRequestError) as e:
                call()
            assert e.value.body["param"] == "temperature", e.value.body


def test_too_many_prompts_is_reported_against_prompt(forklm_server):
    """The default limits (1024 requests in flight, 1024 samples): 2000 prompts break both; the
    client is told its prompts are too many, not that `n` (which it never set) is."""
    client = forklm_server.client(timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["x"] * 2000, max_tokens=1)
    assert e.value.body["param"] == "prompt", e.value.body
    assert "2000 prompts" in e.value.body["message"] and "1024" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # n = 2 for each of 600 prompts: the prompts fit, n does not
        client.completions.create(model=MODEL, prompt=["x"] * 600, n=2, max_tokens=1)
    assert e.value.body["param"] == "n", e.value.body
    assert "600 prompts" in e.value.body["message"]
    ok(forklm_server)


def test_max_requests_limit_is_reachable(smollm2_f32):
    """A request with more prompts than --max-requests is a 400 naming that limit (checked before
    tokenizing), even when --max-samples is larger; as many prompts as the limit run. (A 503 +
    Retry-After would tell the client to retry a request that can never fit.)"""
    from forklm.server.app import ServerConfig, _Server
    from forklm.server.errors import APIError
    from forklm.server.protocol import CompletionBody, parse_body

    srv = _Server(smollm2_f32, ServerConfig(model_name=MODEL, max_requests=2, max_samples=100,
                                            engine_options={"num_blocks": 64}))
    try:
        with pytest.raises(APIError) as e:
            srv.jobs_for(parse_body(CompletionBody, {"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": 1}))
        assert e.value.status == 400 and e.value.param == "prompt"
        assert "3 prompts" in e.value.message and "at most 2" in e.value.message
        jobs = srv.jobs_for(parse_body(CompletionBody, {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1}))
        srv.submit(jobs, stream_tokens=False, request_id="cmpl-test")
        assert [len(j.stream.result(60).samples) for j in jobs] == [1, 1]
    finally:
        srv.loop.close()


HUGE = "m" * 2**20


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": HUGE, "prompt": CODE}, 404, "model"),
        ({"model": MODEL, "prompt": CODE, HUGE: 1}, 400, HUGE),
        ({"model": MODEL, "prompt": CODE, "metadata": {HUGE: 1}}, 400, "metadata." + HUGE),
        ({"model": MODEL, "messages": [{"role": HUGE, "content": "hi"}]}, 400, "messages[0].role"),
    ],
)
def test_errors_quote_bad_values_cut_short(forklm_server, body, status, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = raw_post(forklm_server, json.dumps(body).encode(), path=path)
    assert r.status_code == status, r.text[:300]
    err = r.json()["error"]
    assert len(r.content) < 1000, r.text[:300]
    assert err["param"] == (param if len(param) <= 100 else param[:100] + "...")
    if HUGE in json.dumps(body) and status == 404:
        assert "m" * 100 + "..." in err["message"]
    ok(forklm_server)


def test_disconnect_before_the_stream_starts_cancels_it(forklm_server):
    """The client sends a streaming request and leaves at once: the engine stops its samples and
    releases their blocks. (Over uvicorn's h11 the response's generator still starts and cancels;
    test_server_inprocess drives the ASGI 2.4 case where it never starts.)"""
    wait_idle(forklm_server)
    before = forklm_server.metrics()["forklm_step_seconds_count"]
    for path, body in [("/v1/completions", {"prompt": CODE}), ("/v1/chat/completions", {"messages": CHAT})]:
        data = json.dumps({"model": MODEL, "n": 2, "max_tokens": 4000, "stream": True, "ignore_eos": True,
                           **body}).encode()
        send_raw(forklm_server, post_head(forklm_server, path, len(data)) + data)
    idle = wait_idle(forklm_server, timeout=20)
    assert idle["forklm_step_seconds_count"] - before < 400  # far fewer than 2 x 4000 tokens
    ok(forklm_server)


def test_chunked_body_over_the_limit_is_cut_off_while_read(forklm_server):
    """An endless chunked body gets its 413 after about the limit (4 MiB) is read, not never."""
    sent = 0

    def endless():
        nonlocal sent
        yield b'{"model": "smollm2-135m", "prompt": "'
        while sent < 256 * 2**20:
            sent += 2**16
            yield b"a" * 2**16

    headers = {"Authorization": f"Bearer {forklm_server.api_key}", "Content-Type": "application/json"}
    r = httpx.post(forklm_server.url + "/v1/completions", content=endless(), headers=headers, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert sent < 32 * 2**20  # the limit, plus what the sockets' buffers took
    # a declared length over the limit is refused before reading
    r = raw_post(forklm_server, b'{"model": "smollm2-135m", "prompt": "' + b"a" * (5 * 2**20) + b'"}')
    assert r.status_code == 413
    ok(forklm_server)


def test_scrapes_are_answered_in_turn(forklm_server):
    """/metrics is open: unthrottled scrapers used to keep the event loop (and the GIL) busy and
    slow generation several-fold. Scrapes are answered at most one per 0.1 s, in turn."""
    from concurrent.futures import ThreadPoolExecutor

    def scrape(_):
        return httpx.get(forklm_server.url + "/metrics", timeout=30).status_code

    t0 = time.monotonic()
    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(scrape, range(6))) == [200] * 6
    assert time.monotonic() - t0 >= 0.45
