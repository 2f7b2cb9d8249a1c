"""The request's sampling surface is declared once (`SamplingOptions`): `LLM.sample`'s keywords,
`Request`'s fields, the engine's `SamplingParams` and the server's body all derive from it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from forklm import LLM, Request, SamplingOptions, SamplingParams
from forklm.errors import InvalidArgumentError
from forklm.sampling.params import OPTION_NAMES

# each option -> the server body field(s) that set it (OpenAI's names where OpenAI has one)
SERVER_FIELDS = {
    "n": ["n"], "max_tokens": ["max_tokens", "max_completion_tokens"], "min_tokens": ["min_tokens"],
    "temperature": ["temperature"], "top_p": ["top_p"], "top_k": ["top_k"], "seed": ["seed"], "stop": ["stop"],
    "stop_token_ids": ["stop_token_ids"], "ignore_eos": ["ignore_eos"], "top_logprobs": ["top_logprobs", "logprobs"],
    "json_schema": ["response_format", "guided_json"], "regex": ["guided_regex"], "grammar": ["guided_grammar"],
    "choice": ["guided_choice"], "jump_forward": ["jump_forward"], "speculative": ["speculative"],
    "time_budget_s": ["time_budget_s"], "beam_width": ["use_beam_search", "best_of"],
    "length_penalty": ["length_penalty"], "early_stopping": ["early_stopping"],
    "num_beam_groups": ["num_beam_groups"], "diversity_penalty": ["diversity_penalty"],
}


def test_sample_request_and_params_derive_from_the_options():
    sig = inspect.signature(LLM.sample)
    assert set(OPTION_NAMES) <= set(sig.parameters)  # every option is a keyword of sample (help() shows it)
    for name in OPTION_NAMES:
        if name not in ("n", "speculative"):  # sample's own n and its richer speculative
            f = next(f for f in dataclasses.fields(SamplingOptions) if f.name == name)
            assert sig.parameters[name].default == f.default
    request_fields = [f.name for f in dataclasses.fields(Request)]
    assert set(request_fields) == {"prompt", *OPTION_NAMES}
    params_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert params_fields == {*OPTION_NAMES, "attention", "constraint"}
    assert set(SERVER_FIELDS) == set(OPTION_NAMES)


def test_every_option_has_a_server_parameter():
    from forklm.server.protocol import ChatBody, CompletionBody

    fields = set(ChatBody.model_fields) | set(CompletionBody.model_fields)
    for option, names in SERVER_FIELDS.items():
        assert set(names) <= fields, (option, names)


def test_options_are_normalised_and_checked_once_at_construction():
    r = Request("hi", stop="a", stop_token_ids=[3, 4], choice=["x", "y"])
    assert r.stop == ("a",) and r.stop_token_ids == (3, 4) and r.choice == ("x", "y")
    with pytest.raises(InvalidArgumentError, match="top_p must be"):
        Request("hi", top_p=0)
    with pytest.raises(InvalidArgumentError, match="stop must be"):
        SamplingOptions(stop=5)
    with pytest.raises(InvalidArgumentError, match="only one constraint"):
        Request("hi", regex="a", choice=["a"]).params()
    p = Request("hi", json_schema={"type": "object"}, n=2).params(attention="standard")
    assert p.constraint is not None and p.constraint.kind == "json_schema" and p.attention == "standard"
    assert len({p, dataclasses.replace(p)}) == 1  # hashable though the schema is a dict; replace keeps it
    assert dataclasses.replace(p, n=3).constraint == p.constraint


def test_sample_names_an_unknown_keyword(smollm2_f32):
    with pytest.raises(InvalidArgumentError, match=r"unknown keyword arguments \['temprature'\].*temperature"):
        smollm2_f32.sample([1, 2, 3], n=2, temprature=0.5)
    with pytest.raises(InvalidArgumentError, match="max_tokens must be"):
        smollm2_f32.sample([1, 2, 3], max_tokens=0)
    out = smollm2_f32.sample([1, 2, 3], n=2, max_tokens=3, seed=4, stop=["zzz"])
    again = smollm2_f32.generate([Request([1, 2, 3], n=2, max_tokens=3, seed=4, stop="zzz")])[0]
    assert [s.token_ids for s in out.samples] == [s.token_ids for s in again.samples]
