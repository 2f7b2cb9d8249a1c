"""Constraints over HTTP with the real `openai` client: OpenAI's response_format (json_schema,
json_object, and the client's own `parse` with a pydantic model) and vLLM's guided_* parameters,
on chat and completions; streamed text equals the whole; bad constraints are 400s naming the
parameter."""

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from test_constraints import PET_SCHEMA
from test_server import MODEL, collect_stream, ok

CHAT = [{"role": "user", "content": "Describe a pet as JSON."}]


def test_chat_response_format_json_schema_equals_llm_sample(forklm_server, smollm2_f32):
    kw = dict(n=4, max_tokens=80, temperature=1.0, seed=21)
    r = forklm_server.client().chat.completions.create(
        model=MODEL, messages=CHAT,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True}},
        **kw)
    ref = smollm2_f32.sample(CHAT, json_schema=PET_SCHEMA, **kw)
    assert [c.message.content for c in r.choices] == [s.text for s in ref.samples]
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PET_SCHEMA)


def test_openai_parse_with_a_pydantic_model(forklm_server):
    class Owner(pydantic.BaseModel):
        first: str = pydantic.Field(max_length=10)
        vip: bool

    class Pet(pydantic.BaseModel):
        kind: str = pydantic.Field(pattern="^(cat|dog)$")
        age: int = pydantic.Field(ge=0, le=30)
        owner: Owner

    r = forklm_server.client().chat.completions.parse(model=MODEL, messages=CHAT, response_format=Pet, n=3,
                                                      max_tokens=60, seed=22)
    for c in r.choices:
        assert isinstance(c.message.parsed, Pet) and c.message.parsed.kind in ("cat", "dog")


def test_json_object_on_completions_and_chat(forklm_server):
    client = forklm_server.client()
    # "any JSON object" is unbounded: a small max_tokens may cut it; the finished ones parse
    r = client.completions.create(model=MODEL, prompt="A JSON object: ", n=8, max_tokens=40, seed=23,
                                  temperature=0.7, extra_body={"response_format": {"type": "json_object"}})
    done = [c.text for c in r.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(t), dict) for t in done)
    assert all(c.text.startswith("{") for c in r.choices)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, seed=23,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{") and r.choices[0].finish_reason == "length"


def test_vllm_guided_parameters(forklm_server):
    client = forklm_server.client()
    r = client.completions.create(model=MODEL, prompt="Sentiment of 'great food':", n=8, max_tokens=8, seed=24,
                                  extra_body={"guided_choice": ["positive", "negative"]})
    assert {c.text for c in r.choices} <= {"positive", "negative"}
    r = client.completions.create(model=MODEL, prompt="A date: ", n=8, max_tokens=16, seed=25,
                                  extra_body={"guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][1-9]"})
    assert all(re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][1-9]", c.text) for c in r.choices)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, n=4, max_tokens=80, seed=26,
                                       extra_body={"guided_json": json.dumps(PET_SCHEMA)})
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PET_SCHEMA)
    r = client.completions.create(model=MODEL, prompt="A sum: ", n=4, max_tokens=16, seed=27,
                                  extra_body={"guided_grammar": 'start: NUM " + " NUM\nNUM: /[1-9][0-9]?/'})
    assert all(re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", c.text) for c in r.choices)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_streamed_constrained_text_equals_whole(forklm_server, chat):
    client = forklm_server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}}
    if chat:
        kw = dict(model=MODEL, messages=CHAT, n=3, max_tokens=80, seed=28, response_format=fmt, logprobs=True)
        create = client.chat.completions.create
    else:
        kw = dict(model=MODEL, prompt="A pet as JSON: ", n=3, max_tokens=80, seed=28, logprobs=1,
                  extra_body={"response_format": fmt})
        create = client.completions.create
    whole = create(**kw)
    texts, finish, lps, _ = collect_stream(create(stream=True, **kw), chat=chat)
    for c in whole.choices:
        assert texts[c.index] == (c.message.content if chat else c.text)
        assert finish[c.index] == c.finish_reason == "stop"
        assert len(lps[c.index]) == len(c.logprobs.content if chat else c.logprobs.tokens)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_json": {"type": "objec"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "start: foo"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice[1]"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    # compile, then fail at their first mask: found before anything is queued
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format"),
    ({"guided_regex": "a{1000000}"}, "guided_regex"),
])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bad_constraints_are_400_naming_the_parameter(forklm_server, body, param, chat):
    client = forklm_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=body)
        else:
            client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert e.value.body["type"] == "invalid_request_error"
    ok(forklm_server)




def test_jump_forward_extension(forklm_server, smollm2_f32):
    client = forklm_server.client()
    kw = {"n": 3, "max_tokens": 80, "temperature": 1.0, "seed": 29}
    for jump in (True, False):
        r = client.completions.create(model=MODEL, prompt="A pet as JSON: ",
                                      extra_body={"guided_json": PET_SCHEMA, "jump_forward": jump}, **kw)
        ref = smollm2_f32.sample("A pet as JSON: ", json_schema=PET_SCHEMA, jump_forward=jump, **kw)
        assert [c.text for c in r.choices] == [s.text for s in ref.samples]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "[0-9]+", "jump_forward": "yes"})
    assert e.value.status_code == 400 and e.value.body["param"] == "jump_forward", e.value.body
    ok(forklm_server)
