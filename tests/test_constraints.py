"""Constrained decoding on the real default model: every sample of a JSON schema, regex, grammar
or choice matches it; constraints change no other request's draws; results equal the reference
path's and survive preemption; bad constraints are errors naming their parameter."""

import json
import re

import jsonschema
import pytest

from forklm import LLM, InvalidArgumentError, Request
from forklm.reference.single_request import sample_single_request
from forklm.sampling.constraints import compiled_grammar, make_constraint

PET_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"first": {"type": "string", "maxLength": 10}, "vip": {"type": "boolean"}},
            "required": ["first", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
PET_PROMPT = "Describe a pet as one JSON object:\n"
# (2-3 digit number [+ 2-3 digit number]) in parentheses, as a Lark grammar and as GBNF
SUM_LARK = 'start: "(" NUM (" + " NUM)? ")"\nNUM: /[1-9][0-9]{1,2}/'
SUM_GBNF = 'root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9] [0-9]?'
SUM_RE = r"\([1-9][0-9]{1,2}( \+ [1-9][0-9]{1,2})?\)"


@pytest.mark.parametrize("jump_forward", [True, False], ids=["jump-forward", "masks-only"])
def test_64_samples_validate_against_a_nested_schema(smollm2_f32, jump_forward):
    out = smollm2_f32.sample(PET_PROMPT, n=64, max_tokens=80, temperature=1.0, seed=5, json_schema=PET_SCHEMA,
                             jump_forward=jump_forward)
    for s in out.samples:
        assert s.finish_reason == "stop" and s.stop_reason is None, s
        jsonschema.validate(json.loads(s.text), PET_SCHEMA)
    assert len({s.text for s in out.samples}) > 32  # sampled, not one forced answer


def test_64_samples_match_a_regex(smollm2_f32):
    pattern = r"[A-Z][a-z]{2,8} (Street|Road|Lane) [1-9][0-9]{0,2}"
    out = smollm2_f32.sample("An address: ", n=64, max_tokens=24, temperature=1.0, seed=6, regex=pattern)
    assert all(s.finish_reason == "stop" and re.fullmatch(pattern, s.text) for s in out.samples), \
        [s.text for s in out.samples]


def test_64_samples_are_one_of_their_choices(smollm2_f32):
    choices = ["positive", "negative", "neutral", "it is complicated"]
    out = smollm2_f32.sample("Sentiment of 'the food was cold':", n=64, max_tokens=10, temperature=1.0, seed=7,
                             choice=choices)
    texts = [s.text for s in out.samples]
    assert all(t in choices for t in texts) and len(set(texts)) > 1
    assert all(s.finish_reason == "stop" for s in out.samples)


@pytest.mark.parametrize("grammar", [SUM_LARK, SUM_GBNF], ids=["lark", "gbnf"])
def test_grammar(smollm2_f32, grammar):
    out = smollm2_f32.sample("A small sum: ", n=16, max_tokens=16, temperature=1.0, seed=8, grammar=grammar)
    assert all(s.finish_reason == "stop" and re.fullmatch(SUM_RE, s.text) for s in out.samples), \
        [s.text for s in out.samples]


def test_json_object_and_schema_as_text(smollm2_f32):
    out = smollm2_f32.sample(PET_PROMPT, n=4, max_tokens=12, seed=9, json_schema=json.dumps(PET_SCHEMA))
    ref = smollm2_f32.sample(PET_PROMPT, n=4, max_tokens=12, seed=9, json_schema=PET_SCHEMA)
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in ref.samples]
    assert make_constraint(json_object=True).kind == "json_object"


def test_engine_equals_reference_path_and_logprobs_are_the_models(smollm2_f32):
    # masks only (jump_forward=False): the engine draws every token, as the reference path does
    llm = smollm2_f32
    spec = dict(n=6, max_tokens=40, temperature=0.9, seed=10, json_schema=PET_SCHEMA, top_logprobs=2, jump_forward=False)
    out = llm.sample(PET_PROMPT, **spec)
    ref = sample_single_request(llm, PET_PROMPT, **spec)
    for a, b in zip(out.samples, ref.samples):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3
        assert len(a.top_logprobs) == len(a.token_ids)


def test_constrained_and_unconstrained_in_one_batch(smollm2_f32):
    llm = smollm2_f32
    free = Request("def add(a, b):\n    ", n=4, max_tokens=16, temperature=1.0, seed=11)
    free_top = Request("Once upon a time", n=3, max_tokens=12, temperature=0.8, top_p=0.9, seed=12)
    constrained = Request(PET_PROMPT, n=4, max_tokens=80, temperature=1.0, seed=11, json_schema=PET_SCHEMA)
    choice = Request("Pick:", n=3, max_tokens=6, temperature=0.8, top_p=0.9, seed=12, choice=["left", "right"])
    outs = llm.generate([free, constrained, free_top, choice])
    for req, out in zip([free, constrained, free_top, choice], outs):
        alone = llm.generate([req])[0]
        assert [s.token_ids for s in out.samples] == [s.token_ids for s in alone.samples]
    for s in outs[1].samples:
        jsonschema.validate(json.loads(s.text), PET_SCHEMA)
    assert {s.text for s in outs[3].samples} <= {"left", "right"}


def test_matchers_survive_preemption_and_waves(smollm2_f32):
    llm = smollm2_f32
    # 40 digits (one token each): 12 samples x 3 blocks cannot all run in 40 blocks
    specs = [dict(prompt="Forty digits: ", n=12, max_tokens=40, temperature=1.0, seed=13, regex="[0-9]{40}",
                  jump_forward=False),
             dict(prompt="Numbers: ", n=6, max_tokens=30, temperature=0.9, seed=14, ignore_eos=True)]
    engine = llm.engine(num_blocks=40, block_size=16)
    states = [engine.add_request(llm.prompt_token_ids(s["prompt"]), Request.from_any(s).params()) for s in specs]
    engine.run()
    assert engine.metrics.preempted_samples > 0 and engine.blocks_in_use() == 0
    for spec, st in zip(specs, states):
        ref = sample_single_request(llm, **spec)
        assert [s.token_ids for s in st.output.samples] == [s.token_ids for s in ref.samples]
    assert all(re.fullmatch("[0-9]{40}", s.text) and s.finish_reason == "stop" for s in states[0].output.samples)


def test_too_few_tokens_end_with_length(smollm2_f32):
    out = smollm2_f32.sample(PET_PROMPT, n=4, max_tokens=5, seed=15, json_schema=PET_SCHEMA)
    assert all(s.finish_reason == "length" and len(s.token_ids) == 5 for s in out.samples)
    assert all(s.text.startswith('{"name": "') for s in out.samples)


def test_min_tokens_and_stop_strings_with_a_constraint(smollm2_f32):
    # min_tokens cannot keep a finished choice going: the grammar's end wins
    out = smollm2_f32.sample("Pick:", n=4, max_tokens=8, min_tokens=6, seed=16, choice=["yes", "no"])
    assert all(s.text in ("yes", "no") and s.finish_reason == "stop" for s in out.samples)
    # a stop string still cuts a constrained sample
    out = smollm2_f32.sample(PET_PROMPT, n=4, max_tokens=40, seed=17, json_schema=PET_SCHEMA, stop=['"kind"'])
    assert all(s.stop_reason == '"kind"' and s.text.endswith(", ") for s in out.samples)


@pytest.mark.parametrize("kwargs, param", [
    (dict(json_schema={"type": "objec"}), "json_schema"),
    (dict(json_schema='{"type": "object",'), "json_schema"),
    (dict(json_schema=[1, 2]), "json_schema"),
    (dict(json_schema={"type": "string", "pattern": "(("}), "json_schema"),
    (dict(regex="a(b"), "regex"),
    (dict(regex=""), "regex"),
    (dict(grammar="start: foo"), "grammar"),
    (dict(grammar=42), "grammar"),
    (dict(choice=[]), "choice"),
    (dict(choice="yes"), "choice"),
    (dict(choice=["a", 1]), "choice"),
    (dict(regex="a", choice=["a"]), "choice"),
    (dict(json_schema={"$ref": "#"}), "json_schema"),  # compiles, then fails at its first mask
    (dict(regex="a{1000000}"), "regex"),  # past llguidance's lexer limits
])
def test_bad_constraints_name_their_parameter(smollm2_f32, kwargs, param):
    engine = smollm2_f32.default_engine()
    with pytest.raises(InvalidArgumentError, match=rf"^{param}\b"):
        smollm2_f32.sample("x", max_tokens=4, **kwargs)
    with pytest.raises(InvalidArgumentError, match=rf"^{param}\b"):
        smollm2_f32.generate([Request("y", max_tokens=4), dict(prompt="x", max_tokens=4, **kwargs)])
    assert not engine.has_unfinished() and engine.blocks_in_use() == 0


def test_random_weights_refuse_constraints():
    llm = LLM("random:smollm2-135m", dtype="float32", device="cpu")
    with pytest.raises(InvalidArgumentError, match=r"^regex: this model has no tokenizer"):
        llm.sample([1, 2, 3], max_tokens=4, regex="[0-9]+")


def test_compilation_is_cached_by_text():
    a = make_constraint(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = make_constraint(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert a == b
    hits = compiled_grammar.cache_info().hits
    compiled_grammar(b)
    assert compiled_grammar.cache_info().hits == hits + 1
