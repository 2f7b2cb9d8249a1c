"""The HTTP server through the real `openai` client (and raw httpx for malformed requests), against
a real `forklm serve` process of the default model; results compared with `LLM.sample`."""

import math

import httpx
import openai
import pytest

MODEL = "smollm2-135m"
CODE = "def fibonacci(n):\n    "
CHAT = [{"role": "user", "content": "Name a colour."}]


def collect_stream(chunks, chat: bool) -> tuple[dict, dict, dict, list]:
    """Per choice index: text, finish_reason, logprob entries; and the usage chunks."""
    texts, finish, lps, usage = {}, {}, {}, []
    for chunk in chunks:
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for ch in chunk.choices:
            piece = (ch.delta.content if chat else ch.text) or ""
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason is not None:
                assert ch.index not in finish, "a choice finished twice"
                finish[ch.index] = ch.finish_reason
            if ch.logprobs is not None:
                entries = ch.logprobs.content if chat else list(
                    zip(ch.logprobs.tokens, ch.logprobs.token_logprobs, ch.logprobs.text_offset))
                lps.setdefault(ch.index, []).extend(entries or [])
    return texts, finish, lps, usage


def test_completions_equal_llm_sample(forklm_server, smollm2_f32):
    client = forklm_server.client()
    kw = dict(n=4, max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    r = client.completions.create(model=MODEL, prompt=CODE, logprobs=3, **kw)
    ref = smollm2_f32.sample(CODE, top_logprobs=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c, s in zip(r.choices, ref.samples):
        assert c.text == s.text
        assert c.finish_reason == s.finish_reason
        assert len(c.logprobs.token_logprobs) == len(s.token_ids)
        for got, want in zip(c.logprobs.token_logprobs, s.logprobs):
            assert abs(got - want) < 1e-3
        # each position lists the 3 alternatives (and the chosen token), best first
        for pos, alts in enumerate(c.logprobs.top_logprobs):
            assert 3 <= len(alts) <= 4
            assert max(alts.values()) == pytest.approx(s.top_logprobs[pos][0][1], abs=1e-3)
        assert "".join(c.logprobs.tokens) == s.text or s.finish_reason == "stop"
        # each token's text_offset points at its text inside the completion
        for tok, off in zip(c.logprobs.tokens, c.logprobs.text_offset):
            if not tok.startswith("bytes:") and off < len(c.text):
                assert c.text[off:].startswith(tok) or c.text[off:] == tok[: len(c.text) - off]
        assert c.logprobs.text_offset == sorted(c.logprobs.text_offset)
        assert c.model_extra["mean_logprob"] == pytest.approx(s.mean_logprob, abs=1e-4)
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in ref.samples)
    assert r.object == "text_completion" and r.model == MODEL


def test_completions_stream_equals_whole(forklm_server):
    client = forklm_server.client()
    kw = dict(model=MODEL, prompt=CODE, n=3, max_tokens=20, temperature=1.0, seed=11, logprobs=1, stop=["\n\n"])
    whole = client.completions.create(**kw)
    texts, finish, lps, usage = collect_stream(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw), chat=False)
    for c in whole.choices:
        assert texts[c.index] == c.text
        assert finish[c.index] == c.finish_reason
        assert [t for t, _, _ in lps[c.index]] == c.logprobs.tokens
        assert [v for _, v, _ in lps[c.index]] == pytest.approx(c.logprobs.token_logprobs, abs=1e-4)
        assert [o for _, _, o in lps[c.index]] == c.logprobs.text_offset
    assert len(usage) == 1 and usage[0].completion_tokens == whole.usage.completion_tokens


def test_chat_equals_llm_sample_and_streams(forklm_server, smollm2_f32):
    client = forklm_server.client()
    kw = dict(n=3, max_tokens=24, temperature=0.9, seed=5)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, top_logprobs=2, **kw)
    ref = smollm2_f32.sample(CHAT, **kw)
    assert r.object == "chat.completion"
    for c, s in zip(r.choices, ref.samples):
        assert c.message.role == "assistant"
        assert c.message.content == s.text
        assert c.finish_reason == s.finish_reason
        assert [e.logprob for e in c.logprobs.content] == pytest.approx(s.logprobs, abs=1e-3)
        assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
        assert b"".join(bytes(e.bytes) for e in c.logprobs.content).decode("utf-8", "replace").startswith(s.text)
    texts, finish, lps, _ = collect_stream(
        client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, logprobs=True, top_logprobs=2, **kw),
        chat=True)
    assert [texts[i] for i in range(3)] == [s.text for s in ref.samples]
    assert [finish[i] for i in range(3)] == [s.finish_reason for s in ref.samples]
    assert [len(lps[i]) for i in range(3)] == [len(s.token_ids) for s in ref.samples]


def test_stop_strings_and_max_completion_tokens(forklm_server, smollm2_f32):
    client = forklm_server.client()
    r = client.completions.create(model=MODEL, prompt=CODE, n=6, max_tokens=40, temperature=1.0, seed=3,
                                  stop=["\n", "return"])
    ref = smollm2_f32.sample(CODE, n=6, max_tokens=40, temperature=1.0, seed=3, stop=["\n", "return"])
    assert [c.text for c in r.choices] == [s.text for s in ref.samples]
    for c in r.choices:
        assert "\n" not in c.text and "return" not in c.text
    assert any(c.finish_reason == "stop" for c in r.choices)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


def test_seed_reproducible_and_token_prompts(forklm_server, smollm2_f32):
    client = forklm_server.client()
    kw = dict(model=MODEL, n=2, max_tokens=12, temperature=1.0)
    a = client.completions.create(prompt=CODE, seed=123, **kw)
    b = client.completions.create(prompt=CODE, seed=123, **kw)
    c = client.completions.create(prompt=CODE, seed=124, **kw)
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert [x.text for x in a.choices] != [x.text for x in c.choices]
    ids = smollm2_f32.tokenizer.encode(CODE)
    d = client.completions.create(prompt=ids, seed=123, **kw)  # a prompt of token ids
    assert [x.text for x in d.choices] == [x.text for x in a.choices]


def test_several_prompts_get_n_choices_each(forklm_server, smollm2_f32):
    client = forklm_server.client()
    prompts = ["import numpy as np\n", "class Stack:\n"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0.7, seed=9)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        ref = smollm2_f32.sample(prompt, n=2, max_tokens=8, temperature=0.7, seed=9)
        assert [r.choices[p * 2 + i].text for i in range(2)] == [s.text for s in ref.samples]
    assert r.usage.prompt_tokens == sum(len(smollm2_f32.tokenizer.encode(p)) for p in prompts)


def test_best_of_returns_the_best_by_mean_logprob(forklm_server, smollm2_f32):
    client = forklm_server.client()
    r = client.completions.create(model=MODEL, prompt=CODE, n=2, best_of=6, max_tokens=16, temperature=1.0, seed=21)
    ref = smollm2_f32.sample(CODE, n=6, max_tokens=16, temperature=1.0, seed=21)
    best = sorted(ref.samples, key=lambda s: -s.mean_logprob)[:2]
    assert [c.text for c in r.choices] == [s.text for s in best]
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == sum(len(s.token_ids) for s in ref.samples)  # all six were generated


def test_rank_extension_dedups_and_orders(forklm_server):
    client = forklm_server.client()
    greedy = client.completions.create(model=MODEL, prompt=CODE, n=5, max_tokens=8, temperature=0,
                                       extra_body={"rank": True})
    assert len(greedy.choices) == 1  # five equal greedy samples: one distinct text
    r = client.chat.completions.create(model=MODEL, messages=CHAT, n=8, max_tokens=10, temperature=1.2, seed=2,
                                       extra_body={"rank": True})
    means = [c.model_extra["mean_logprob"] for c in r.choices]
    assert means == sorted(means, reverse=True)
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) == len(texts)
    assert [c.index for c in r.choices] == list(range(len(r.choices)))


def test_models_health_metrics(forklm_server):
    client = forklm_server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert httpx.get(forklm_server.url + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt=CODE, max_tokens=2)
    m = forklm_server.metrics()
    for name in ("forklm_requests_running", "forklm_requests_waiting", "forklm_kv_blocks_in_use",
                 "forklm_prefix_cache_hit_rate", "forklm_prompt_tokens_total", "forklm_generation_tokens_total",
                 "forklm_time_to_first_token_seconds_count", "forklm_step_seconds_count",
                 "forklm_e2e_request_latency_seconds_count", "process_resident_memory_bytes"):
        assert name in m, name
    assert m["forklm_prompt_tokens_total"] > 0 and m["forklm_generation_tokens_total"] > 0
    assert m["forklm_step_seconds_count"] > 0 and m["forklm_time_to_first_token_seconds_count"] > 0


def test_prefix_cache_hit_reported_in_usage(forklm_server):
    client = forklm_server.client()
    prompt = "# a long shared context\n" + "x = [i * i for i in range(100)]\n" * 12
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 16


# ---------------------------------------------------------------------- errors


def ok(server) -> None:
    """A good request right after a bad one: the server keeps serving."""
    r = server.client().completions.create(model=MODEL, prompt=CODE, max_tokens=1)
    assert len(r.choices) == 1


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(n=0), "n"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=6), "logprobs"),
        (dict(best_of=1, n=2), "best_of"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (dict(presence_penalty=0.5), "presence_penalty"),
        (dict(extra_body={"top_k": -1}), "top_k"),
        (dict(extra_body={"min_tokens": 9}, max_tokens=4), "min_tokens"),
        (dict(extra_body={"bogus_param": 1}), "bogus_param"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[10**9]), "prompt"),
        (dict(seed=-1), "seed"),
        (dict(n="2"), "n"),
    ],
)
def test_invalid_parameters_are_400_naming_them(forklm_server, kwargs, param):
    client = forklm_server.client()
    kwargs = {"prompt": CODE, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, max_tokens=kwargs.pop("max_tokens", 4), **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    ok(forklm_server)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "user"}]), "messages[0].content"),
        (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages[0].content"),
        (dict(messages=CHAT, top_logprobs=2), "top_logprobs"),
        (dict(messages=CHAT, tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
        (dict(messages=CHAT, max_completion_tokens=0), "max_completion_tokens"),
    ],
)
def test_invalid_chat_parameters_are_400(forklm_server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        forklm_server.client().chat.completions.create(model=MODEL, **kwargs)
    assert e.value.body["param"] == param, e.value.body
    ok(forklm_server)


def test_auth_model_and_context_errors(forklm_server):
    with pytest.raises(openai.AuthenticationError) as e:
        forklm_server.client(api_key="wrong").completions.create(model=MODEL, prompt=CODE, max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    ok(forklm_server)
    r = httpx.post(forklm_server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and "error" in r.json()
    with pytest.raises(openai.NotFoundError) as e:
        forklm_server.client().completions.create(model="gpt-4", prompt=CODE, max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    ok(forklm_server)
    long_prompt = "word " * 9000  # SmolLM2's context is 8192 tokens
    with pytest.raises(openai.BadRequestError) as e:
        forklm_server.client().completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded"
    ok(forklm_server)
    with pytest.raises(openai.BadRequestError) as e:
        forklm_server.client().completions.create(model=MODEL, prompt=CODE, max_tokens=8190)
    assert e.value.body["code"] == "context_length_exceeded"
    ok(forklm_server)


def raw_post(server, content: bytes, path: str = "/v1/completions", **headers) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json", **headers}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize(
    "content, words",
    [
        (b'{"model": "smollm2-135m", "prompt": "x"', "not valid JSON"),
        (b"\xff\xfe{}", "UTF-8"),
        (b'{"model": "smollm2-135m", "prompt": "caf\xe9"}', "UTF-8"),
        (b'[1, 2, 3]', "JSON object"),
        (b'{"model": "smollm2-135m", "prompt": "x", "temperature": NaN}', "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_malformed_bodies_are_400(forklm_server, content, words):
    r = raw_post(forklm_server, content)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    ok(forklm_server)


def test_oversized_body_is_413_and_unknown_route_404(forklm_server):
    big = b'{"model": "smollm2-135m", "prompt": "' + b"a" * (5 * 2**20) + b'"}'
    r = raw_post(forklm_server, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    ok(forklm_server)
    r = raw_post(forklm_server, b"{}", path="/v1/embeddings")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(forklm_server.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    ok(forklm_server)


def test_queue_limit_is_503_with_retry_after(smollm2_gguf):
    from forklm.server.process import ServerProcess

    server = ServerProcess("--dtype", "float32", "--max-requests", "2", "--memory-gib", "0.5")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            body = {"model": MODEL, "prompt": CODE, "max_tokens": 4000, "stream": True, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as s1, \
                    http.stream("POST", "/v1/completions", json=body) as s2:
                assert s1.status_code == 200 and s2.status_code == 200
                r = http.post("/v1/completions", json={"model": MODEL, "prompt": CODE, "max_tokens": 1})
                assert r.status_code == 503
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
                with pytest.raises(openai.APIStatusError) as e:
                    server.client().completions.create(model=MODEL, prompt=CODE, max_tokens=1)
                assert e.value.status_code == 503
            wait_idle(server)
        ok(server)
    finally:
        server.stop()


def wait_idle(server, timeout: float = 30.0) -> dict:
    """Polls /metrics until nothing runs and no KV block is in use; returns the last sample (the
    benchmark's helper, bench/serve_soak.py; it raises if the server is not idle within `timeout`)."""
    from bench.serve_soak import wait_idle as until_idle

    return until_idle(server, timeout)


def test_finite_mean_logprob(forklm_server):
    r = forklm_server.client().completions.create(model=MODEL, prompt=CODE, max_tokens=3)
    assert math.isfinite(r.choices[0].model_extra["mean_logprob"])
