"""Requests that used to get a 500, hang the server or be refused though OpenAI's API takes them;
each answered properly now, and the server keeps serving (a real `forklm serve`, as in test_server)."""

import httpx
import openai
import pytest
from test_server import CHAT, CODE, MODEL, ok, raw_post, wait_idle


@pytest.mark.parametrize(
    "content",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"model": "smollm2-135m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ],
)
def test_deeply_nested_json_is_400(forklm_server, content):
    r = raw_post(forklm_server, content)
    assert r.status_code == 400, r.text
    assert "nested too deeply" in r.json()["error"]["message"]
    ok(forklm_server)


@pytest.mark.parametrize(
    "content, path",
    [
        (b'{"model": "smollm2-135m", "prompt": "x\\ud800", "max_tokens": 2}', "/v1/completions"),
        (b'{"model": "smollm2-135m", "prompt": ["ok", "\\udfff"], "max_tokens": 2}', "/v1/completions"),
        (b'{"model": "smollm2-135m", "messages": [{"role": "user", "content": "\\uD83D"}]}', "/v1/chat/completions"),
        (b'{"model": "\\ud800", "prompt": "x"}', "/v1/completions"),
    ],
)
def test_unpaired_surrogate_escapes_are_400(forklm_server, content, path):
    r = raw_post(forklm_server, content, path=path)
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]
    # a proper pair is one character and fine
    r = raw_post(forklm_server, b'{"model": "smollm2-135m", "prompt": "\\ud83d\\ude00", "max_tokens": 1}')
    assert r.status_code == 200, r.text
    ok(forklm_server)


def test_stop_token_ids_outside_the_vocabulary_are_400(forklm_server):
    """With min_tokens they used to reach the sampler's mask and fail the engine step: a 500 for this
    request and for every other request in that step."""
    client = forklm_server.client()
    for extra in ({"stop_token_ids": [49152]}, {"stop_token_ids": [2, 10**6], "min_tokens": 2}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=CODE, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == "stop_token_ids", e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                       extra_body={"stop_token_ids": [10**6], "min_tokens": 2})
    assert e.value.body["param"] == "stop_token_ids"
    ok(forklm_server)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(n=10**12), "n"),
        (dict(n=2, best_of=10**9), "best_of"),
        (dict(n=600, prompt=[CODE, CODE]), "n"),  # 1200 samples in all
    ],
)
def test_absurd_sample_counts_are_400(forklm_server, kwargs, param):
    """n = 10**12 used to make the engine thread build 10**12 sample states: the server hung and
    its memory grew until it was killed."""
    kwargs = {"prompt": CODE, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        forklm_server.client(timeout=20).completions.create(model=MODEL, max_tokens=2, **kwargs)
    assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        forklm_server.client(timeout=20).chat.completions.create(model=MODEL, messages=CHAT, n=10**9, max_tokens=2)
    assert e.value.body["param"] == "n"
    ok(forklm_server)
    wait_idle(forklm_server, timeout=10)


def test_explicit_nulls_mean_the_default(forklm_server):
    """OpenAI's optional parameters are nullable; clients that pass None through send them."""
    client = forklm_server.client()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, n=None, stream=None, logprobs=None,
                                       top_logprobs=None, temperature=None, stop=None, seed=None,
                                       stream_options=None, extra_body={"top_k": None, "ignore_eos": None})
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt=CODE, max_tokens=3, n=None, stream=None, echo=None,
                                  best_of=None, logprobs=None, suffix=None, extra_body={"rank": None})
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": None}))
    assert chunks and all(c.usage is None for c in chunks)
    # required parameters stay required
    r = raw_post(forklm_server, b'{"model": "smollm2-135m", "prompt": null}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    ok(forklm_server)


def test_health_after_the_bad_requests(forklm_server):
    assert httpx.get(forklm_server.url + "/health").json() == {"status": "ok"}


def test_zero_logit_bias_is_neutral(forklm_server):
    client = forklm_server.client()
    r = client.completions.create(model=MODEL, prompt=CODE, max_tokens=2, logit_bias={"50": 0, "7": 0.0})
    assert len(r.choices) == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=CODE, max_tokens=2, logit_bias={"50": 0, "7": -100})
    assert e.value.body["param"] == "logit_bias"


def test_openai_bookkeeping_fields_at_neutral_values_are_accepted(forklm_server):
    client = forklm_server.client()
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, store=False,
                                       metadata={"run": "test"}, service_tier="auto", user="u1")
    assert len(r.choices) == 1
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, store=True)
    assert e.value.body["param"] == "store"
    ok(forklm_server)
