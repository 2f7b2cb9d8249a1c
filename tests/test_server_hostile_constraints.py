"""Malformed and hostile constraints sent as raw HTTP to a real `forklm serve`, on completions and
chat alike: OpenAI's response_format and vLLM's guided_json / guided_regex / guided_grammar /
guided_choice with wrong types at every level, schemas and regexes and grammars llguidance cannot
compile or that nothing satisfies, past its limits, nested or chained thousands deep, huge, with
NaN or unpaired surrogates, two at once, with n > 1 and stream. Each is either a 400 in OpenAI's
error shape naming the parameter, in one short line (no parser-state dump), or, where the request
is valid and satisfiable, a 200 whose text matches it; never a 5xx or a hang, and the server keeps
serving after each."""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

MODEL = "smollm2-135m"
TIMEOUT_S = 60  # a hang fails the test instead of the session


@dataclass(frozen=True)
class Raw:
    """Request members as JSON text, for what json.dumps will not write (nesting past Python's
    parser, unpaired surrogate escapes)."""

    text: str


@dataclass(frozen=True)
class Ok:
    """A valid, satisfiable constraint: 200, and every choice's text passes `check(text, finish_reason)`;
    `choices` of them (None: at least one, as `rank` de-duplicates)."""

    check: Callable[[str, str], bool]
    choices: int | None = 1


def RF(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def run_of(pattern: str) -> Callable[[str, str], bool]:
    """A text that matches `pattern`, a run that max_tokens may cut anywhere."""
    return lambda text, finish: re.fullmatch(pattern, text) is not None


def one_of(options) -> Callable[[str, str], bool]:
    options = set(options)
    return lambda text, finish: finish == "stop" and text in options


def json_value(check: Callable[[object], bool], opens: str) -> Callable[[str, str], bool]:
    """Finished: the text is JSON passing `check`; cut by max_tokens: it starts as such a value does."""
    def run(text: str, finish: str) -> bool:
        if finish == "stop":
            return check(json.loads(text))
        return finish == "length" and text[:1] in opens
    return run


def only_a_keys(value) -> bool:
    return isinstance(value, dict) and set(value) <= {"a"} and all(only_a_keys(v) for v in value.values())


def deep_text(depth: int) -> str:
    """A schema of objects nested `depth` deep, as JSON text (json.dumps would recurse past Python's limit)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth


ENUM_50K = [f"v{i}" for i in range(50_000)]
WORDS = [f"w{i}" for i in range(50_000)]
OPTIONS = [f"option {i}" for i in range(1500)]
REF_CHAIN = {"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)} | {"d5000": {"type": "integer"}},
             "$ref": "#/$defs/d0"}
RULE_CHAIN = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(5000)) + 'r5000: "x" r5000 | "y"\n'
GROUP_CHAIN = ("start: r0\n" + "".join(f"r{i}: " + "(" * 24 + f"r{i + 1}" + ")" * 24 + "\n" for i in range(1500))
               + 'r1500: "z"\n')


def bad(param: str):
    return ("400", param)


CASES = [
    # ---- the two of the issue
    pytest.param(RF({"$ref": "#"}), bad("response_format"), id="rf-self-ref"),
    pytest.param({"guided_regex": "a{1000000}"}, bad("guided_regex"), id="regex-repeat-1e6"),
    # ---- response_format: wrong types at every level
    pytest.param({"response_format": "json_object"}, bad("response_format"), id="rf-a-string"),
    pytest.param({"response_format": [{"type": "json_object"}]}, bad("response_format"), id="rf-a-list"),
    pytest.param({"response_format": {}}, bad("response_format"), id="rf-no-type"),
    pytest.param({"response_format": {"type": 1}}, bad("response_format"), id="rf-type-int"),
    pytest.param({"response_format": {"type": "JSON_OBJECT"}}, bad("response_format"), id="rf-type-unknown"),
    pytest.param({"response_format": {"type": "json_schema"}}, bad("response_format"), id="rf-no-json-schema"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": "{}"}}, bad("response_format"),
                 id="rf-json-schema-a-string"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, bad("response_format"),
                 id="rf-no-schema"),
    pytest.param(RF([{"type": "string"}]), bad("response_format"), id="rf-schema-a-list"),
    pytest.param(RF('{"type": "string"}'), bad("response_format"), id="rf-schema-a-string"),
    pytest.param(RF(None), bad("response_format"), id="rf-schema-null"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "x": 1}}},
                 bad("response_format"), id="rf-json-schema-unknown-key"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}},
                 bad("response_format"), id="rf-name-int"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes",
                                                                             "schema": {}}}},
                 bad("response_format"), id="rf-strict-a-string"),
    pytest.param({"response_format": {"type": "json_object", "schema": {"type": "array"}}}, bad("response_format"),
                 id="rf-json-object-with-a-schema"),
    # ---- schemas llguidance cannot compile
    pytest.param(RF({"type": "float"}), bad("response_format"), id="schema-type-unknown"),
    pytest.param(RF({"type": ["string", 5]}), bad("response_format"), id="schema-type-list-with-int"),
    pytest.param(RF({"type": "object", "properties": [1]}), bad("response_format"), id="schema-properties-a-list"),
    pytest.param(RF({"type": "string", "pattern": "(?<=a)b"}), bad("response_format"), id="schema-pattern-lookbehind"),
    pytest.param(RF({"type": "string", "pattern": "(a)\\1"}), bad("response_format"), id="schema-pattern-backref"),
    pytest.param(RF({"type": "string", "pattern": "^a{1000000}$"}), bad("response_format"),
                 id="schema-pattern-repeat-1e6"),
    pytest.param(RF({"type": "string", "format": "no-such-format"}), bad("response_format"),
                 id="schema-format-unknown"),
    pytest.param(RF({"type": "integer", "multipleOf": 0}), bad("response_format"), id="schema-multipleof-0"),
    pytest.param(RF({"type": "string", "minLength": -1}), bad("response_format"), id="schema-minlength-negative"),
    pytest.param(RF({"type": "string", "maxLength": 10**12}), bad("response_format"), id="schema-maxlength-1e12"),
    pytest.param(RF({"type": "string", "x-guidance": {"bogus": 1}}), bad("response_format"),
                 id="schema-x-guidance-unknown"),
    pytest.param(RF({"type": "object", "x-guidance": {"whitespace_pattern": "("}}), bad("response_format"),
                 id="schema-x-guidance-bad-regex"),
    pytest.param(RF({"not": {}}), bad("response_format"), id="schema-not"),
    pytest.param(RF({"$ref": "#/$defs/nope"}), bad("response_format"), id="schema-ref-missing"),
    pytest.param(RF({"$ref": "http://127.0.0.1:9/schema.json"}), bad("response_format"), id="schema-ref-remote"),
    # ---- schemas nothing satisfies, or recursive without end
    pytest.param(RF({"type": "string", "minLength": 5, "maxLength": 2}), bad("response_format"),
                 id="schema-minlength-over-maxlength"),
    pytest.param(RF({"allOf": [{"type": "string"}, {"type": "integer"}]}), bad("response_format"),
                 id="schema-allof-string-and-integer"),
    pytest.param(RF({"type": "integer", "minimum": 10, "maximum": 1}), bad("response_format"),
                 id="schema-minimum-over-maximum"),
    pytest.param(RF({"type": "string", "enum": ["a"], "const": "b"}), bad("response_format"),
                 id="schema-enum-and-other-const"),
    pytest.param(RF({"enum": []}), bad("response_format"), id="schema-enum-empty"),
    pytest.param(RF({"anyOf": []}), bad("response_format"), id="schema-anyof-empty"),
    pytest.param(RF({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False}),
                 bad("response_format"), id="schema-required-but-forbidden"),
    pytest.param(RF({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
                 bad("response_format"), id="schema-ref-cycle"),
    pytest.param(RF({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"],
                     "additionalProperties": False}), bad("response_format"), id="schema-required-self-ref"),
    # ---- schemas too large or too deep
    pytest.param(RF({"enum": [f"value-{i}" for i in range(200_000)]}), bad("response_format"),
                 id="schema-enum-200k-3MB"),
    pytest.param(Raw('"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": '
                     + deep_text(10_000) + "}}"), bad("response_format"), id="schema-depth-10k"),
    pytest.param({"guided_json": deep_text(10_000)}, bad("guided_json"), id="guided-json-text-depth-10k"),
    pytest.param({"guided_json": json.loads(deep_text(300))}, bad("guided_json"), id="guided-json-depth-300"),
    pytest.param({"guided_json": {"type": "string", "description": "x" * (2 << 20)}}, bad("guided_json"),
                 id="guided-json-2MB"),
    # the body limit (4 MiB) comes before any parameter is read: 413, OpenAI's status for it
    pytest.param(RF({"type": "string", "description": "x" * (5 << 20)}), ("413", None), id="schema-5MB"),
    # ---- guided_json: wrong types, not JSON
    pytest.param({"guided_json": True}, bad("guided_json"), id="guided-json-bool"),
    pytest.param({"guided_json": [1]}, bad("guided_json"), id="guided-json-list"),
    pytest.param({"guided_json": "null"}, bad("guided_json"), id="guided-json-text-null"),
    pytest.param({"guided_json": ""}, bad("guided_json"), id="guided-json-text-empty"),
    pytest.param({"guided_json": '{"type": "string"} extra'}, bad("guided_json"), id="guided-json-text-trailing"),
    pytest.param({"guided_json": '{"type": "number", "minimum": NaN}'}, bad("guided_json"), id="guided-json-nan"),
    pytest.param({"guided_json": '{"type": "number", "maximum": Infinity}'}, bad("guided_json"),
                 id="guided-json-infinity"),
    # ---- guided_regex
    pytest.param({"guided_regex": 123}, bad("guided_regex"), id="regex-int"),
    pytest.param({"guided_regex": ""}, bad("guided_regex"), id="regex-empty"),
    pytest.param({"guided_regex": "a)b"}, bad("guided_regex"), id="regex-unopened-paren"),
    pytest.param({"guided_regex": "(a|b"}, bad("guided_regex"), id="regex-unclosed-paren"),
    pytest.param({"guided_regex": "\\q"}, bad("guided_regex"), id="regex-bad-escape"),
    pytest.param({"guided_regex": "(?<=a)b"}, bad("guided_regex"), id="regex-lookbehind"),
    pytest.param({"guided_regex": "a(?=b)"}, bad("guided_regex"), id="regex-lookahead"),
    pytest.param({"guided_regex": "(a)\\1"}, bad("guided_regex"), id="regex-backref"),
    pytest.param({"guided_regex": "a{2,1}"}, bad("guided_regex"), id="regex-range-reversed"),
    pytest.param({"guided_regex": "a{0,4294967296}"}, bad("guided_regex"), id="regex-repeat-overflow"),
    pytest.param({"guided_regex": "(a{1000}){1000}"}, bad("guided_regex"), id="regex-nested-repeat-1e6"),
    pytest.param({"guided_regex": "\\p{NoSuchClass}"}, bad("guided_regex"), id="regex-unknown-class"),
    pytest.param({"guided_regex": "[^\\s\\S]"}, bad("guided_regex"), id="regex-matches-nothing"),
    pytest.param({"guided_regex": "(" * 1000 + "a" + ")" * 1000}, bad("guided_regex"), id="regex-parens-1000-deep"),
    pytest.param(Raw('"guided_regex": "a\\ud800"'), bad("guided_regex"), id="regex-unpaired-surrogate"),
    # ---- guided_grammar (Lark, GBNF)
    pytest.param({"guided_grammar": ["start: \"a\""]}, bad("guided_grammar"), id="grammar-a-list"),
    pytest.param({"guided_grammar": ""}, bad("guided_grammar"), id="grammar-empty"),
    pytest.param({"guided_grammar": "start: ("}, bad("guided_grammar"), id="grammar-syntax-error"),
    pytest.param({"guided_grammar": 'foo: "a"\nbar: foo "b"'}, bad("guided_grammar"), id="grammar-lark-no-start"),
    pytest.param({"guided_grammar": 'foo ::= "a"'}, bad("guided_grammar"), id="grammar-gbnf-no-root"),
    pytest.param({"guided_grammar": "root ::= foo"}, bad("guided_grammar"), id="grammar-gbnf-undefined-rule"),
    pytest.param({"guided_grammar": 'start: start "a"'}, bad("guided_grammar"), id="grammar-empty-language"),
    pytest.param({"guided_grammar": 'start: "a"\nstart: "b"'}, bad("guided_grammar"), id="grammar-duplicate-rule"),
    pytest.param({"guided_grammar": "start: /(?<=a)b/"}, bad("guided_grammar"), id="grammar-lookbehind-terminal"),
    pytest.param({"guided_grammar": "start: /a{1000000}/"}, bad("guided_grammar"), id="grammar-repeat-1e6"),
    pytest.param({"guided_grammar": "start: " + "(" * 1000 + '"a"' + ")" * 1000}, bad("guided_grammar"),
                 id="grammar-parens-1000-deep"),
    # ---- guided_choice
    pytest.param({"guided_choice": "yes"}, bad("guided_choice"), id="choice-a-string"),
    pytest.param({"guided_choice": []}, bad("guided_choice"), id="choice-empty"),
    pytest.param({"guided_choice": [1, 2]}, bad("guided_choice[0]"), id="choice-ints"),
    pytest.param({"guided_choice": [None]}, bad("guided_choice[0]"), id="choice-null"),
    pytest.param({"guided_choice": [["yes"]]}, bad("guided_choice[0]"), id="choice-nested-list"),
    pytest.param({"guided_choice": ["", "yes"]}, bad("guided_choice"), id="choice-empty-string"),
    pytest.param({"guided_choice": [f"option {i}" for i in range(3000)]}, bad("guided_choice"),
                 id="choice-3000-past-llguidance-row-limit"),
    pytest.param(Raw('"guided_choice": ["yes", "\\udfff"]'), bad("guided_choice"), id="choice-unpaired-surrogate"),
    # ---- two constraints at once; with n > 1 and stream
    pytest.param({"guided_json": {"type": "string"}, "guided_regex": "a"}, bad("guided_regex"),
                 id="two-guided-json-and-regex"),
    pytest.param({**RF({"type": "string"}), "guided_choice": ["a"]}, bad("guided_choice"),
                 id="two-response-format-and-choice"),
    pytest.param({"response_format": {"type": "json_object"}, "guided_json": {"type": "string"}}, bad("guided_json"),
                 id="two-json-object-and-guided-json"),
    pytest.param({"guided_regex": "a(", "n": 2, "stream": True}, bad("guided_regex"), id="stream-n2-bad-regex"),
    pytest.param({**RF({"$ref": "#"}), "n": 2, "stream": True}, bad("response_format"), id="stream-n2-self-ref"),
    # ---- valid and satisfiable, however odd: 200 and the text matches
    # recursive, but the recursion is optional: {} ends it
    pytest.param(RF({"type": "object", "properties": {"a": {"$ref": "#"}}, "additionalProperties": False}),
                 Ok(json_value(only_a_keys, "{")), id="ok-schema-optional-self-ref"),
    pytest.param(RF({"enum": ENUM_50K}), Ok(json_value(lambda v: v in set(ENUM_50K), '"')), id="ok-schema-enum-50k"),
    # a 100k-item array is satisfiable, just long: max_tokens cuts it
    pytest.param(RF({"type": "array", "items": {"type": "integer"}, "minItems": 100_000}),
                 Ok(run_of(r"\[(-?\d+, )*-?\d*,?")),
                 id="ok-schema-min-items-100k"),
    pytest.param(RF({"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}),
                 Ok(json_value(lambda v: isinstance(v, int) or isinstance(v, str) and len(v) <= 3, '-0123456789"')),
                 id="ok-schema-oneof"),
    # a $ref chain 5000 long (it overflowed llguidance's stack and killed the server)
    pytest.param(RF(REF_CHAIN), Ok(json_value(lambda v: isinstance(v, int), "-0123456789")),
                 id="ok-schema-ref-chain-5000"),
    pytest.param({"guided_json": "true"}, Ok(json_value(lambda v: True, '{["-0123456789tfn')),
                 id="ok-guided-json-text-true"),
    pytest.param({"guided_regex": "(?:)"}, Ok(one_of([""])), id="ok-regex-only-the-empty-string"),
    pytest.param({"guided_regex": "(?:)*"}, Ok(one_of([""])), id="ok-regex-star-of-empty"),
    pytest.param({"guided_regex": "a{100}{100}"}, Ok(run_of("a+")), id="ok-regex-repeat-of-repeat"),
    pytest.param({"guided_regex": "(.*){100000}"}, Ok(run_of(".*")),
                 id="ok-regex-repeat-of-dot-star"),
    pytest.param({"guided_regex": "|".join(WORDS)}, Ok(one_of(WORDS)), id="ok-regex-50k-alternatives"),
    pytest.param({"guided_regex": "\u0000"}, Ok(one_of(["\u0000"])), id="ok-regex-nul"),
    pytest.param({"guided_regex": "😀{1,3}", "max_tokens": 16}, Ok(one_of(["😀", "😀😀", "😀😀😀"])),
                 id="ok-regex-emoji"),
    pytest.param({"guided_grammar": 'start: start "a" | "a"', "max_tokens": 4},
                 Ok(run_of("a+")), id="ok-grammar-left-recursive"),
    pytest.param({"guided_grammar": 'root ::= "yes" | "no"'}, Ok(one_of(["yes", "no"])), id="ok-grammar-gbnf"),
    pytest.param({"guided_grammar": "%import common.WORD\nstart: WORD"},
                 Ok(run_of("[A-Za-z]+")), id="ok-grammar-lark-import"),
    # rule chains and nested groups thousands deep (they overflowed llguidance's stack and killed the server)
    pytest.param({"guided_grammar": RULE_CHAIN}, Ok(run_of("x*y?")),
                 id="ok-grammar-rule-chain-5000"),
    pytest.param({"guided_grammar": GROUP_CHAIN}, Ok(one_of(["z"])), id="ok-grammar-nested-group-chain"),
    pytest.param({"guided_choice": ["yes", "yes"]}, Ok(one_of(["yes"])), id="ok-choice-duplicates"),
    pytest.param({"guided_choice": OPTIONS}, Ok(one_of(OPTIONS)), id="ok-choice-1500"),
    pytest.param({"guided_choice": ["😀", "日本"]}, Ok(one_of(["😀", "日本"])), id="ok-choice-non-ascii"),
    # {"type": "text"} is no constraint: the regex is the only one
    pytest.param({"response_format": {"type": "text"}, "guided_regex": "[0-9]{3}"}, Ok(one_of(f"{i:03}" for i in
                 range(1000))), id="ok-text-format-and-regex"),
    pytest.param({"guided_choice": ["yes", "no"], "n": 3, "stream": True}, Ok(one_of(["yes", "no"]), choices=3),
                 id="ok-stream-n3-choice"),
    pytest.param({"response_format": {"type": "json_object"}, "n": 2, "stream": True},
                 Ok(json_value(lambda v: isinstance(v, dict), "{"), choices=2), id="ok-stream-n2-json-object"),
    pytest.param({"guided_regex": "[ab]{2}", "n": 4, "rank": True, "temperature": 1.5, "seed": 1},
                 Ok(one_of(["aa", "ab", "ba", "bb"]), choices=None), id="ok-rank-n4-regex"),
]


def _headers(server) -> dict:
    return {"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"}


def _body(extra, chat: bool) -> bytes:
    base = {"model": MODEL, "max_tokens": 8}
    base |= {"messages": [{"role": "user", "content": "Answer."}]} if chat else {"prompt": "Answer: "}
    if isinstance(extra, Raw):
        return (json.dumps(base)[:-1] + ", " + extra.text + "}").encode()
    return json.dumps(base | extra, ensure_ascii=False).encode()


def _choices(r: httpx.Response, chat: bool, stream: bool) -> dict[int, tuple[str, str]]:
    """Each choice's (text, finish_reason), from the whole response or its server-sent events."""
    if not stream:
        return {c["index"]: (c["message"]["content"] if chat else c["text"], c["finish_reason"])
                for c in r.json()["choices"]}
    assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
    texts, finish = {}, {}
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        for c in chunk["choices"]:
            piece = c["delta"].get("content") if chat else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c["finish_reason"] is not None:
                finish[c["index"]] = c["finish_reason"]
    return {i: (texts[i], finish.get(i)) for i in texts}


def _still_serving(server) -> None:
    assert httpx.get(server.url + "/health", timeout=TIMEOUT_S).json() == {"status": "ok"}
    r = httpx.post(server.url + "/v1/completions", headers=_headers(server), timeout=TIMEOUT_S,
                   json={"model": MODEL, "prompt": "def fibonacci(n):\n    ", "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text


@pytest.mark.parametrize("extra, expect", CASES)
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_hostile_constraint(forklm_server, extra, expect, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(forklm_server.url + path, content=_body(extra, chat), headers=_headers(forklm_server),
                   timeout=TIMEOUT_S)
    assert r.status_code < 500, r.text[:500]
    if isinstance(expect, Ok):
        assert r.status_code == 200, r.text[:500]
        choices = _choices(r, chat, stream=isinstance(extra, dict) and extra.get("stream", False))
        assert len(choices) == expect.choices if expect.choices is not None else choices, choices
        for text, finish in choices.values():
            assert finish in ("stop", "length"), (text, finish)
            assert expect.check(text, finish), (text, finish)
    else:
        status, param = expect
        assert r.status_code == int(status), r.text[:500]
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        message = err["message"]
        assert isinstance(message, str) and message, err
        # one short line: no parser-state dump, no quoted source with ^^^ markers under it
        assert "\n" not in message and len(message) <= 400 and "^^" not in message, message
        assert param is None or param in message or "request body" in message, message
    _still_serving(forklm_server)
