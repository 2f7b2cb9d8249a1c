"""Per-sample book-keeping shared by the single-request path (`forked.py`) and the engine.

`draw_next` samples one token for each of a request's live samples from their logits rows,
with sample i's randomness from (seed, i, step); `check_finished` applies EOS / stop token /
stop string / max_tokens rules after each new token; `to_sample` builds the user-facing result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from forklm.outputs import Sample
from forklm.sampling.params import SamplingParams
from forklm.sampling.sampler import model_logprobs, sample_tokens
from forklm.sampling.seeds import counter_uniform


class SampleState:
    """One sample while it runs: its tokens, log-probs and why it ended (once it has)."""

    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "stop_reason", "text", "checked")

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text: str | None = None  # set when a stop string cut it
        self.checked = 0  # characters of decoded text already searched for stop strings

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def stop_token_set(params: SamplingParams, eos_token_ids: Sequence[int]) -> set[int]:
    return set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))


def draw_next(
    logits: torch.Tensor,  # [b, V] float32, row r for states[r]
    states: Sequence[SampleState],
    params: SamplingParams,
    seed: int,
    stop_ids: set[int],
) -> tuple[list[int], list[float]]:
    """Samples the next token of each state (its step is how many tokens it has) and appends it."""
    step_of = [len(s.token_ids) for s in states]
    masked = logits
    early = [r for r, t in enumerate(step_of) if t < params.min_tokens]
    if early and stop_ids:
        masked = logits.clone()
        banned = torch.tensor(sorted(stop_ids), dtype=torch.long, device=logits.device)
        rows = torch.tensor(early, dtype=torch.long, device=logits.device)
        masked[rows.unsqueeze(1), banned.unsqueeze(0)] = float("-inf")
    u = torch.tensor([counter_uniform(seed, s.index, t) for s, t in zip(states, step_of)], dtype=torch.float64)
    tokens = sample_tokens(masked, params.temperature, params.top_k, params.top_p, u)
    lps = model_logprobs(logits, tokens)
    tokens_list, lps_list = tokens.tolist(), lps.tolist()
    for st, tok, lp in zip(states, tokens_list, lps_list):
        st.token_ids.append(tok)
        st.logprobs.append(lp)
    return tokens_list, lps_list


def check_finished(
    st: SampleState, params: SamplingParams, stop_ids: set[int], decode: Callable[[list[int]], str]
) -> bool:
    """Records why a sample ends after its latest token, if it does."""
    tok = st.token_ids[-1]
    can_stop = len(st.token_ids) > params.min_tokens
    if can_stop and tok in stop_ids:
        st.finish_reason, st.stop_reason = "stop", tok
        return True
    if params.stop:
        text = decode(st.token_ids)
        if not can_stop:  # stop strings count only after min_tokens
            st.checked = len(text)
            return _length_reached(st, params)
        longest = max(len(s) for s in params.stop)
        start = max(0, st.checked - longest + 1)
        hits = [(pos, s) for s in params.stop if (pos := text.find(s, start)) >= 0]
        st.checked = len(text)
        if hits:
            pos, s = min(hits)
            st.text = text[:pos]
            st.finish_reason, st.stop_reason = "stop", s
            return True
    return _length_reached(st, params)


def _length_reached(st: SampleState, params: SamplingParams) -> bool:
    if len(st.token_ids) >= params.max_tokens:
        st.finish_reason = "length"
        return True
    return False


def to_sample(st: SampleState, decode: Callable[[list[int]], str]) -> Sample:
    text = st.text
    if text is None:
        ids_for_text = st.token_ids
        if st.finish_reason == "stop" and isinstance(st.stop_reason, int):
            ids_for_text = ids_for_text[:-1]  # the stop token is not part of the text
        text = decode(ids_for_text)
    return Sample(st.index, text, st.token_ids, st.logprobs, st.finish_reason or "length", st.stop_reason)
