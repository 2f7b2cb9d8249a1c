"""The request bodies the server accepts, validated by pydantic, and their mapping to forklm.

OpenAI's parameters keep OpenAI's meaning. Parameters OpenAI has but forklm does not implement
(penalties, logit_bias, echo, suffix, tools) are accepted only at their neutral value, so a
client that sends the default still works and one that relies on them gets a 400 naming the
parameter, not a silently different result. Unknown parameters are a 400, as in OpenAI's API.
forklm's extensions: `top_k`, `min_tokens`, `stop_token_ids`, `ignore_eos`, and `rank` (choices
de-duplicated by text and ordered by mean log-probability). Constraints (`constraint_of`):
OpenAI's `response_format` ({"type": "json_schema", "json_schema": {"schema": ...}} or
{"type": "json_object"}) and vLLM's `guided_json`, `guided_regex`, `guided_grammar`,
`guided_choice`, on chat and completions alike; at most one per request.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from forklm.errors import InvalidArgumentError
from forklm.sampling.constraints import Constraint, make_constraint
from forklm.sampling.params import MAX_TOP_LOGPROBS
from forklm.server.errors import APIError, clip, invalid

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for the completions `logprobs` integer


def _accepts_none(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(annotation)


class _NullMeansDefault(BaseModel):
    """OpenAI's optional parameters are nullable ("n": null, "stream": null, "logprobs": null are
    valid requests): an explicit null of an optional parameter means its default."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required()
                        and not _accepts_none(fields[k].annotation))}


class StreamOptions(_NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Body(_NullMeansDefault):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's range (the LLM API allows more)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-tracking field
    service_tier: str | None = None  # accepted and ignored: one tier here
    store: bool | None = None  # only false: forklm does not store completions
    metadata: dict[str, str] | None = None  # accepted and ignored (it labels stored completions)
    # neutral-only OpenAI parameters
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's constraint extensions
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    # forklm extensions
    top_k: int = Field(0, ge=0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    rank: bool = False
    jump_forward: bool = True  # a constrained sample appends each run its grammar forces in one step
    speculative: bool = True  # false: this request decodes one token per step on a speculating server
    time_budget_s: float | None = Field(None, gt=0)  # then unfinished samples end with finish_reason "time"
    # vLLM's beam search extension: beam width best_of (completions) or n; the n best hypotheses return
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    num_beam_groups: int = Field(1, ge=1)  # diverse beam search (forklm extension)
    diversity_penalty: float = Field(0.0, ge=0)


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


def parse_body(cls: type[_Body], data: Any) -> _Body:
    """Validates a decoded JSON body; a 400 naming the first offending parameter otherwise."""
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object")
    try:
        body = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err.get("loc", ())
        param = clip(_param_path(loc))  # a client's key may be any length
        if err.get("type") == "extra_forbidden":
            raise invalid(f"Unrecognized request argument supplied: {param}", param=param) from None
        if err.get("type") == "missing":
            raise invalid(f"Missing required parameter: {param}", param=param) from None
        if loc and loc[0] == "prompt":
            raise invalid("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                          "token ids", param="prompt") from None
        if len(loc) >= 3 and loc[0] == "messages" and loc[2] == "content":
            raise invalid("message content must be a string or a list of {'type': 'text', 'text': ...} parts "
                          "(forklm's models read text only)", param=param) from None
        raise invalid(f"Invalid value for {param}: {err.get('msg', 'invalid')}", param=param) from None
    _check_neutral(body)
    return body


def _param_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[str]", "list[int]", "list[list[int]]", "list[TextPart]", "int", "float", "bool",
                      "dict[str,any]"):
            continue  # pydantic names the union member it tried; the parameter is what matters
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def _check_neutral(body: _Body) -> None:
    def unsupported(name: str, why: str = "is not supported by forklm") -> APIError:
        return invalid(f"{name} {why}", param=name)

    if body.presence_penalty not in (None, 0):
        raise unsupported("presence_penalty", "is not supported by forklm (only 0)")
    if body.frequency_penalty not in (None, 0):
        raise unsupported("frequency_penalty", "is not supported by forklm (only 0)")
    if body.logit_bias and any(v != 0 for v in body.logit_bias.values()):
        raise unsupported("logit_bias", "is not supported by forklm (only biases of 0)")
    if body.store:
        raise unsupported("store", "is not supported by forklm (completions are not stored; only false)")
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    if isinstance(body.stop, list) and len(body.stop) > 4:
        raise invalid("stop may hold at most 4 strings", param="stop")
    if body.stop is not None and any(s == "" for s in ([body.stop] if isinstance(body.stop, str) else body.stop)):
        raise invalid("stop strings must not be empty", param="stop")
    if body.stop_token_ids is not None and any(t < 0 for t in body.stop_token_ids):
        raise invalid("stop_token_ids must be token ids >= 0", param="stop_token_ids")
    if body.use_beam_search:
        if body.stream:
            raise invalid("use_beam_search cannot be streamed (a hypothesis is known only when the search ends)",
                          param="use_beam_search")
        for name, default in (("temperature", 1.0), ("top_p", 1.0)):
            if getattr(body, name) not in (None, default, 0 if name == "temperature" else default):
                raise invalid(f"{name} does not apply to beam search (deterministic); leave it unset",
                              param=name)
        if body.top_k:
            raise invalid("top_k does not apply to beam search (deterministic); leave it unset", param="top_k")
    else:
        for param, default in (("length_penalty", 1.0), ("early_stopping", False), ("num_beam_groups", 1),
                               ("diversity_penalty", 0.0)):
            if getattr(body, param) != default:
                raise invalid(f"{param} applies to beam search only (use_beam_search: true)", param=param)
    if isinstance(body, CompletionBody):
        if body.echo:
            raise unsupported("echo")
        if body.suffix:
            raise unsupported("suffix")
        if body.best_of is not None and body.best_of < body.n:
            raise invalid(f"best_of ({body.best_of}) must be >= n ({body.n})", param="best_of")
        if body.best_of is not None and body.best_of > body.n and body.stream:
            raise invalid("best_of > n cannot be streamed", param="best_of")
        if isinstance(body.prompt, list) and len(body.prompt) == 0:
            raise invalid("prompt must not be empty", param="prompt")
    if isinstance(body, ChatBody):
        if body.tools:
            raise unsupported("tools")
        if body.tool_choice not in (None, "none"):
            raise unsupported("tool_choice")
        if body.top_logprobs is not None and not body.logprobs:
            raise invalid("top_logprobs requires logprobs to be true", param="top_logprobs")
    if body.rank and body.stream:
        raise invalid("rank needs every choice before ordering them and cannot be streamed", param="rank")



GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}


def constraint_of(body: _Body, check: Callable[[Constraint], None] | None = None) -> Constraint | None:
    """The request's constraint, compiled once to check it (and `check`ed: the model's tokenizer
    binding walks its first masks); a 400 naming the parameter the client used otherwise (at most
    one of response_format and the guided_* parameters)."""
    given = [name for name in ("response_format", *GUIDED) if getattr(body, name) is not None]
    if body.response_format == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise invalid(f"only one constraint per request; got {' and '.join(given)}", param=given[1])
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        kind, arguments = _response_format(body.response_format)
    else:
        kind, arguments = GUIDED[name], {GUIDED[name]: getattr(body, name)}
    try:
        constraint = make_constraint(**arguments)
        if check is not None and constraint is not None:
            check(constraint)
        return constraint
    except InvalidArgumentError as e:  # forklm names its own parameter first: name the client's
        message = str(e)
        if message.startswith(kind):
            message = message[len(kind):]
        raise invalid(f"{name}{message}", param=name) from None


def _response_format(value: dict) -> tuple[str, dict]:
    """OpenAI's response_format as make_constraint's arguments."""
    kind = value.get("type")
    if kind == "json_object" and set(value) == {"type"}:
        return "json_object", {"json_object": True}
    if kind == "json_schema" and set(value) <= {"type", "json_schema"}:
        spec = value.get("json_schema")
        if isinstance(spec, dict) and isinstance(spec.get("schema"), dict) \
                and set(spec) <= {"name", "schema", "strict", "description"} and isinstance(spec.get("name", ""), str) \
                and isinstance(spec.get("description"), (str, type(None))) \
                and isinstance(spec.get("strict"), (bool, type(None))):
            return "json_schema", {"json_schema": spec["schema"]}
        raise invalid("response_format.json_schema must be an object with a 'schema' object (and optionally "
                      "'name' and 'description' strings and a boolean 'strict')", param="response_format")
    raise invalid(f"response_format must be {{'type': 'text'}}, {{'type': 'json_object'}} or {{'type': "
                  f"'json_schema', 'json_schema': {{'name': ..., 'schema': {{...}}}}}}, got {clip(value)}",
                  param="response_format")
