"""Per-sample sampling state and its rules, shared by the engine and the reference single-request path.

`draw_next` samples one token for each of a request's live samples from their logits rows,
with sample i's randomness from (seed, i, step); a constrained sample's row is masked first to
the tokens its grammar allows (`constraints.py`). `check_finished` feeds the new token to the
sample's grammar and applies its end and the EOS / stop token / stop string / max_tokens rules;
`to_sample` builds the user-facing result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from forklm.errors import ModelOutputError
from forklm.outputs import Sample
from forklm.sampling.constraints import SampleMatcher, masked_logits
from forklm.sampling.params import SamplingParams
from forklm.sampling.sampler import model_logprobs, sample_tokens
from forklm.sampling.seeds import counter_uniforms


class SampleState:
    """One sample while it runs: its tokens, log-probs and why it ended (once it has)."""

    __slots__ = (
        "ahead",
        "checked",
        "finish_reason",
        "index",
        "logprobs",
        "matcher",
        "score",
        "stop_reason",
        "text",
        "token_ids",
        "top_logprobs",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] | None = None  # when params.top_logprobs > 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text: str | None = None  # set when a stop string cut it
        self.checked = 0  # characters of decoded text already searched for stop strings
        self.matcher: SampleMatcher | None = None  # its place in its grammar, when constrained
        # Known tokens after `token_ids` (a run its grammar forces: jump-forward), already consumed by
        # the matcher, whose log-probs come from the next forward; they become sample tokens then.
        self.ahead: list[int] = []
        self.score: float | None = None  # a beam search hypothesis's score (sampling/beam.py)

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
    b = len(states)
    return draw_rows(logits, states, [params] * b, [seed] * b, [stop_ids] * b)


def draw_rows(
    logits: torch.Tensor,  # [b, V] float32, row r for states[r]
    states: Sequence[SampleState],
    params: Sequence[SamplingParams],  # per row (rows of one request share theirs)
    seeds: Sequence[int],
    stop_ids: Sequence[set[int]],
) -> tuple[list[int], list[float]]:
    """`draw_next` for rows of several requests: rows whose temperature/top-k/top-p agree are
    drawn in one batch (every operation is per row, so the batch does not change a row's draw).
    A constrained row (its state has a matcher) draws only tokens its grammar allows; the
    log-probs recorded stay the model's own."""
    matchers = [s.matcher for s in states]
    tokens = draw_tokens(logits, params, seeds, [s.index for s in states], [len(s.token_ids) for s in states],
                         stop_ids, matchers)
    lps = model_logprobs(logits, tokens)
    tokens_list, lps_list = tokens.tolist(), lps.tolist()
    for st, tok, lp in zip(states, tokens_list, lps_list):
        st.token_ids.append(tok)
        st.logprobs.append(lp)
    _record_top_logprobs(logits, states, params)
    return tokens_list, lps_list


def draw_tokens(
    logits: torch.Tensor,  # [b, V] float32
    params: Sequence[SamplingParams],  # per row
    seeds: Sequence[int],
    sample_indices: Sequence[int],
    steps: Sequence[int],  # per row: the position in its sample of the token drawn (tokens it has)
    stop_ids: Sequence[set[int]],
    matchers: Sequence[SampleMatcher | None] | None = None,  # per row, constrained rows only
) -> torch.Tensor:  # [b] int64
    """The draw itself, a pure function of each row's logits and (seed, sample, step): the token
    non-speculative decoding draws at that position. Rows whose temperature/top-k/top-p agree are
    drawn in one batch (every operation is per row). Speculative verification
    (`forklm/speculative/`) draws here too, so a verified token is the one decoding would draw."""
    constrained = [r for r, m in enumerate(matchers or ()) if m is not None]
    masked = masked_logits(logits, constrained, [matchers[r] for r in constrained]) if constrained else logits
    early = [r for r, t in enumerate(steps) if t < params[r].min_tokens and stop_ids[r]]
    if early and masked is logits:
        masked = logits.clone()
    for r in early:
        grammar_only = masked[r].clone() if matchers and matchers[r] is not None else None
        masked[r, torch.tensor(sorted(stop_ids[r]), dtype=torch.long, device=logits.device)] = float("-inf")
        if grammar_only is not None and bool(torch.isneginf(masked[r]).all()):
            masked[r] = grammar_only  # min_tokens banned all the grammar allows (its end): the grammar wins
    u = counter_uniforms(seeds, sample_indices, steps)
    groups: dict[tuple, list[int]] = {}
    for r, p in enumerate(params):
        groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(r)
    if len(groups) == 1:
        (key,) = groups
        return sample_tokens(masked, *key, u)
    tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    for key, rows in groups.items():
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        tokens[idx] = sample_tokens(masked.index_select(0, idx), *key, u[idx.cpu()])
    return tokens


def _record_top_logprobs(logits: torch.Tensor, states: Sequence[SampleState], params: Sequence[SamplingParams]) -> None:
    """Appends each asking row's most likely tokens (model log-softmax, before temperature etc.)."""
    rows = [r for r, p in enumerate(params) if p.top_logprobs > 0]
    if not rows:
        return
    k = max(params[r].top_logprobs for r in rows)
    sub = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
    values, ids = torch.topk(sub, k, dim=-1)
    values = values - torch.logsumexp(sub, dim=-1, keepdim=True)
    for r, vals, toks in zip(rows, values.tolist(), ids.tolist()):
        st, kr = states[r], params[r].top_logprobs
        if st.top_logprobs is None:
            st.top_logprobs = []
        st.top_logprobs.append(list(zip(toks[:kr], vals[:kr])))


MAX_JUMP_TOKENS = 64  # a forced run longer than this is appended over several steps


def jump_forward(st: SampleState, params: SamplingParams) -> list[int]:
    """After a drawn token that did not end the sample: the run of tokens its grammar forces next
    (`SampleMatcher.take_forced`: consumed by the matcher), as `st.ahead`, never past max_tokens.
    Empty (nothing changes) for an unconstrained sample or with `jump_forward` off."""
    if st.matcher is None or not params.jump_forward:
        return []
    st.ahead = st.matcher.take_forced(min(MAX_JUMP_TOKENS, params.max_tokens - len(st.token_ids)))
    return st.ahead


def check_finite(st: SampleState) -> None:
    """ModelOutputError unless the sample's last token has a number for its log-prob: NaN means its
    row of logits held NaN / +inf or only -inf (a model gone wrong), from which no token is drawn (the
    C++ sampler and argmax would each pick some token; the request stops with this error instead)."""
    lp = st.logprobs[-1]
    if lp != lp:
        raise ModelOutputError(f"the model's logits for sample {st.index} at generated token {len(st.token_ids)} are "
                               "not finite (NaN, +inf or only -inf): no token can be drawn; the request stops")


def accept_ahead(st: SampleState, logprob: float, top: list[tuple[int, float]] | None) -> None:
    """The first known token becomes the sample's next token, with its log-prob from the forward."""
    st.token_ids.append(st.ahead.pop(0))
    st.logprobs.append(logprob)
    if top is not None:
        if st.top_logprobs is None:
            st.top_logprobs = []
        st.top_logprobs.append(top)


def check_finished(
    st: SampleState, params: SamplingParams, stop_ids: set[int], decode: Callable[[list[int]], str],
    forced: bool = False,
) -> bool:
    """Records why a sample ends after its latest token, if it does. `forced`: the token came from
    `ahead` (the matcher consumed it already; the grammar can end only after the run's last one).

    Stop strings: each step decodes only a window of the latest tokens (O(1) per step, not the
    whole sample); only when a stop string shows up there is the whole sample decoded, to cut
    its text exactly where the stop string starts. An occurrence that ends within the text of the
    first min_tokens tokens never stops the sample, then or later.
    """
    tok = st.token_ids[-1]
    can_stop = len(st.token_ids) > params.min_tokens
    if st.matcher is not None:
        if not forced:
            st.matcher.consume(tok)  # raises ConstraintError if the grammar refuses it
        if st.matcher.finished and not st.ahead:  # the grammar is complete (or took its end-of-sequence): nothing can follow
            st.finish_reason, st.stop_reason = "stop", (tok if tok in stop_ids else None)
            return True
    if can_stop and tok in stop_ids:
        st.finish_reason, st.stop_reason = "stop", tok
        return True
    if params.stop:
        if not can_stop:  # stop strings count only after min_tokens: remember where the text was
            if len(st.token_ids) == params.min_tokens:
                st.checked = len(decode(st.token_ids).rstrip("\ufffd"))  # an incomplete character may still change
            return _length_reached(st, params)
        if stop_in_tail(st.token_ids, params.stop, decode):
            text = decode(st.token_ids)
            # only occurrences that end after the min_tokens window's text count
            hits = [(pos, s) for s in params.stop if (pos := text.find(s, max(0, st.checked - len(s) + 1))) >= 0]
            if hits:
                pos, s = min(hits)
                st.text = text[:pos]
                st.finish_reason, st.stop_reason = "stop", s
                return True
    return _length_reached(st, params)


_EDGE_CHARS = 4  # characters at a window's start that may differ from the whole text's


def stop_in_tail(ids: list[int], stops: Sequence[str], decode: Callable[[list[int]], str]) -> bool:
    """Whether a stop string occurs in the text of the latest tokens (a superset test: every stop
    string the latest token completes is found; older ones may be too).

    The decoded window, less its first few characters, is a suffix of the whole text: a window
    may start inside a UTF-8 character (U+FFFD for each stray byte) or lose a leading space
    (SentencePiece). One more case: a byte-fallback decoder (SentencePiece `<0xNN>` tokens)
    turns a whole run of byte tokens into U+FFFDs when the run, cut by the window's start, is
    not valid UTF-8; so while the character after the cut edge is U+FFFD the window grows too.
    A new occurrence ends inside the latest token's text, so the window grows until that suffix
    holds the longest stop string before all of that text (plus a character the latest token
    may have completed).
    """
    longest = max(len(s) for s in stops)
    need = longest + len(decode(ids[-1:])) + 2 * _EDGE_CHARS
    width = longest + 8
    while True:
        start = max(0, len(ids) - width)
        tail = decode(ids[start:])
        if start > 0:
            if len(tail) < need or tail[_EDGE_CHARS] == "\ufffd":
                width *= 2  # special tokens, pieces of characters, a cut byte run: widen
                continue
            tail = tail[_EDGE_CHARS:]
        return any(s in tail for s in stops)


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
    return Sample(st.index, text, st.token_ids, st.logprobs, st.finish_reason or "length", st.stop_reason,
                  st.top_logprobs, st.score)
