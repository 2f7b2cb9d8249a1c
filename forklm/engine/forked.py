"""One request, `n` samples: prefill the prompt once, fork, decode the samples in lockstep.

Data flow: prompt ids -> prefill (prompt KV stored once) -> fork (each sample gets storage for
its own tokens) -> step loop: sample a token per live sample -> stop checks -> finished samples
leave the batch -> one forward over the live samples' new tokens -> ...
"""

from __future__ import annotations

import time

import torch

from forklm.attention.auto import choose_decode_path
from forklm.attention.forked import DecodeAttention, PrefillAttention
from forklm.cache.forked_kv import ForkedKVCache
from forklm.models.llama import LlamaModel
from forklm.outputs import Sample, SampleOutput, Stats
from forklm.sampling.params import SamplingParams
from forklm.sampling.sampler import model_logprobs, sample_tokens
from forklm.sampling.seeds import counter_uniform, fresh_seed


class _SampleState:
    """Book-keeping of one sample while it runs."""

    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "stop_reason", "text", "checked")

    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text: str | None = None  # set when a stop string cut it
        self.checked = 0  # characters of decoded text already searched for stop strings


def generate_forked(
    model: LlamaModel,
    decode,  # (token_ids) -> str, special tokens skipped
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
) -> SampleOutput:
    cfg = model.config
    device = model.device
    n, m_c = params.n, len(prompt_ids)
    seed = params.seed if params.seed is not None else fresh_seed()
    stats = Stats(prompt_tokens=m_c)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    banned_early = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)

    cache = ForkedKVCache(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, m_c, params.max_tokens, n, model.dtype, device
    )
    t0 = time.perf_counter()
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    logits = model.forward(
        ids, torch.arange(m_c, device=device), PrefillAttention(cache), logits_rows=torch.tensor([m_c - 1])
    )  # [1, V]
    _sync(device)
    stats.prefill_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    cache.fork()
    states = [_SampleState(i) for i in range(n)]
    live = list(states)  # row r of the batch is live[r]
    logits = logits.expand(n, -1)
    t_step = time.perf_counter()
    for step in range(params.max_tokens):
        b = len(live)
        masked = logits
        if step < params.min_tokens and banned_early.numel():
            masked = logits.clone()
            masked[:, banned_early] = float("-inf")
        u = torch.tensor([counter_uniform(seed, s.index, step) for s in live], dtype=torch.float64)
        tokens = sample_tokens(masked, params.temperature, params.top_k, params.top_p, u)
        lps = model_logprobs(logits, tokens)
        tokens_list, lps_list = tokens.tolist(), lps.tolist()
        keep: list[int] = []
        for r, st in enumerate(live):
            st.token_ids.append(tokens_list[r])
            st.logprobs.append(lps_list[r])
            if _finished(st, step, params, stop_ids, decode):
                continue
            keep.append(r)
        stats.generated_tokens += b
        if not keep:
            break
        if len(keep) < b:
            rows = torch.tensor(keep, dtype=torch.long, device=device)
            cache.keep_rows(rows)
            live = [live[r] for r in keep]
            tokens = tokens[rows]
        path = params.attention
        if path == "auto":
            path = choose_decode_path(device.type, len(live), m_c, cache.own_len + 1)
        stats.path_steps[path] = stats.path_steps.get(path, 0) + 1
        positions = torch.full((len(live),), m_c + step, dtype=torch.long, device=device)
        logits = model.forward(tokens, positions, DecodeAttention(cache, path))
        cache.own_len += 1
        stats.steps += 1
        _sync(device)
        now = time.perf_counter()
        stats.step_s.append(now - t_step)
        t_step = now
    _sync(device)
    stats.decode_s = time.perf_counter() - t1

    samples = []
    for st in states:
        text = st.text
        if text is None:
            ids_for_text = st.token_ids
            if st.finish_reason == "stop" and isinstance(st.stop_reason, int):
                ids_for_text = ids_for_text[:-1]  # the stop token is not part of the text
            text = decode(ids_for_text)
        samples.append(Sample(st.index, text, st.token_ids, st.logprobs, st.finish_reason or "length", st.stop_reason))
    return SampleOutput(prompt_token_ids=list(prompt_ids), samples=samples, seed=seed, stats=stats)


def _finished(st: _SampleState, step: int, params: SamplingParams, stop_ids: set[int], decode) -> bool:
    """Records why a sample ends after its latest token, if it does."""
    tok = st.token_ids[-1]
    can_stop = step + 1 > params.min_tokens
    if can_stop and tok in stop_ids:
        st.finish_reason, st.stop_reason = "stop", tok
        return True
    if params.stop:
        text = decode(st.token_ids)
        if not can_stop:  # stop strings count only after min_tokens
            st.checked = len(text)
            return len(st.token_ids) >= params.max_tokens and _set_length(st)
        longest = max(len(s) for s in params.stop)
        start = max(0, st.checked - longest + 1)
        hits = [(pos, s) for s in params.stop if (pos := text.find(s, start)) >= 0]
        st.checked = len(text)
        if hits:
            pos, s = min(hits)
            st.text = text[:pos]
            st.finish_reason, st.stop_reason = "stop", s
            return True
    return len(st.token_ids) >= params.max_tokens and _set_length(st)


def _set_length(st: _SampleState) -> bool:
    st.finish_reason = "length"
    return True


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
