"""`forklm serve --speculative` through the real `openai` client: seeded completions equal
`LLM.sample` without speculation token for token, drafts are verified (their stats on /metrics),
a request opts out with `"speculative": false`, `time_budget_s` ends unfinished samples with
finish_reason "time", and bad values are clear 400s (a bad --speculative: a clear exit)."""

import subprocess
import sys

import httpx
import pytest

MODEL = "smollm2-135m"
# code that repeats itself: the n-gram drafter finds its continuations in the prompt
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n")


@pytest.fixture(scope="module")
def spec_server(smollm2_gguf):
    from forklm.server.process import ServerProcess

    # a fixed draft length: drafts every step (the "auto" rule may measure them off on this CPU)
    server = ServerProcess("--dtype", "float32", "--device", "cpu", "--quantize", "none", "--memory-gib", "1",
                           "--speculative", "ngram:3")
    yield server
    server.stop()


def spec_stats(server) -> dict[str, float]:
    return {k: v for k, v in server.metrics().items() if k.startswith("forklm_spec_")}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_completions_equal_llm_sample(spec_server, smollm2_f32, temperature):
    client = spec_server.client()
    before = spec_stats(spec_server)
    kw = dict(n=4, max_tokens=32, temperature=temperature, seed=21)
    r = client.completions.create(model=MODEL, prompt=CODE, logprobs=1, **kw)
    ref = smollm2_f32.sample(CODE, speculative=False, **kw)
    for c, s in zip(r.choices, ref.samples, strict=True):
        assert c.text == s.text
        assert c.finish_reason == s.finish_reason
        assert c.logprobs.token_logprobs == pytest.approx(s.logprobs, abs=1e-3)
    after = spec_stats(spec_server)
    drafted = after["forklm_spec_draft_tokens"] - before["forklm_spec_draft_tokens"]
    accepted = after["forklm_spec_accepted_tokens"] - before["forklm_spec_accepted_tokens"]
    assert drafted > 0 and 0 <= accepted <= drafted
    assert 0 <= after["forklm_spec_acceptance_rate"] <= 1
    assert after["forklm_spec_tokens_per_drafted_row"] >= 1
    assert after["forklm_spec_draft_seconds"] > 0


def test_a_request_opts_out(spec_server, smollm2_f32):
    client = spec_server.client()
    before = spec_stats(spec_server)
    r = client.completions.create(model=MODEL, prompt=CODE, n=2, max_tokens=24, temperature=0.0, seed=1,
                                  extra_body={"speculative": False})
    ref = smollm2_f32.sample(CODE, n=2, max_tokens=24, temperature=0.0, seed=1)
    assert [c.text for c in r.choices] == [s.text for s in ref.samples]
    assert spec_stats(spec_server)["forklm_spec_draft_tokens"] == before["forklm_spec_draft_tokens"]


def test_time_budget_ends_samples_with_finish_reason_time(spec_server, smollm2_f32):
    client = spec_server.client()
    kw = dict(n=3, temperature=0.8, seed=5)
    r = client.completions.create(model=MODEL, prompt=CODE, max_tokens=4000, **kw,
                                  extra_body={"ignore_eos": True, "time_budget_s": 0.5})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.finish_reason for c in r.choices} == {"time"}
    assert 0 < r.usage.completion_tokens < 3 * 4000
    # each unfinished sample's text starts what the same seed gives without a budget
    ref = smollm2_f32.sample(CODE, max_tokens=r.usage.completion_tokens, ignore_eos=True, **kw)
    for c, s in zip(r.choices, ref.samples, strict=True):
        assert s.text.startswith(c.text)
    # ranked by mean log-probability when asked
    r = client.completions.create(model=MODEL, prompt=CODE, max_tokens=4000, **kw,
                                  extra_body={"ignore_eos": True, "time_budget_s": 0.5, "rank": True})
    means = [c.model_extra["mean_logprob"] for c in r.choices]
    assert means == sorted(means, reverse=True) and {c.finish_reason for c in r.choices} == {"time"}
    # a chat request too, streamed
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to a thousand."}], max_tokens=4000, stream=True,
        extra_body={"ignore_eos": True, "time_budget_s": 0.3})
    finish = [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason]
    assert finish == ["time"]
    assert spec_server.metrics()["forklm_requests_in_flight"] == 0


@pytest.mark.parametrize("body, param", [
    ({"time_budget_s": -1}, "time_budget_s"),
    ({"time_budget_s": 0}, "time_budget_s"),
    ({"time_budget_s": "soon"}, "time_budget_s"),
    ({"speculative": "yes"}, "speculative"),
])
def test_bad_speculative_and_budget_values_are_400s(spec_server, body, param):
    r = httpx.post(spec_server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2, **body})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    assert httpx.get(spec_server.url + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("spec, message", [
    ("foo", "method must be one of"),
    ("ngram:x", "ngram:K"),
    ("{not json", "not valid JSON"),
    ('{"method": "ngram", "num_draft_tokens": 99}', "num_draft_tokens"),
    ("draft:", "draft needs a model"),
])
def test_bad_speculative_flag_exits_clearly(spec, message):
    p = subprocess.run([sys.executable, "-m", "forklm", "serve", "--speculative", spec, "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert message in p.stderr and "Traceback" not in p.stderr
