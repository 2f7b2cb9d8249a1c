"""REFERENCE CODE (the test oracle and the bench baseline `single-request`; not a production
path: `LLM.sample` runs on the engine).

One request, `n` samples: prefill the prompt once, fork, decode the samples in lockstep.

Data flow: prompt ids -> prefill (prompt KV stored once) -> fork (each sample gets storage for
its own tokens) -> step loop: sample a token per live sample -> stop checks -> finished samples
leave the batch -> one forward over the live samples' new tokens -> ...
"""

from __future__ import annotations

import time

import torch

from forklm.attention.auto import choose_decode_path
from forklm.reference.forked_attention import DecodeAttention, PrefillAttention
from forklm.reference.forked_kv import ForkedKVCache
from forklm.models.llama import LlamaModel
from forklm.outputs import SampleOutput, Stats
from forklm.errors import InvalidArgumentError
from forklm.sampling.constraints import TokenConstraints, token_constraints
from forklm.sampling.params import SamplingParams
from forklm.sampling.sample_state import SampleState, check_finished, draw_next, stop_token_set, to_sample
from forklm.sampling.seeds import fresh_seed


def generate_single_request(
    model: LlamaModel,
    decode,  # (token_ids) -> str, special tokens skipped
    prompt_ids: list[int],
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
    constraints: TokenConstraints | None = None,  # the tokenizer's binding, for a constrained request
) -> SampleOutput:
    if params.constraint is not None and constraints is None:
        raise InvalidArgumentError(f"{params.constraint.param}: pass the tokenizer's TokenConstraints to constrain text")
    if params.constraint is not None and params.jump_forward:
        raise InvalidArgumentError("jump_forward: the reference path draws every token through the mask; "
                                   "pass jump_forward=False")
    cfg = model.config
    device = model.device
    n, m_c = params.n, len(prompt_ids)
    seed = params.seed if params.seed is not None else fresh_seed()
    stats = Stats(prompt_tokens=m_c)
    stop_ids = stop_token_set(params, eos_token_ids)

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
    states = [SampleState(i) for i in range(n)]
    if params.constraint is not None:
        for st, matcher in zip(states, constraints.matchers(params.constraint, n)):
            st.matcher = matcher
    live = list(states)  # row r of the batch is live[r]
    logits = logits.expand(n, -1)
    t_step = time.perf_counter()
    for step in range(params.max_tokens):
        b = len(live)
        draw_next(logits, live, params, seed, stop_ids)
        keep = [r for r, st in enumerate(live) if not check_finished(st, params, stop_ids, decode)]
        stats.generated_tokens += b
        if not keep:
            break
        if len(keep) < b:
            rows = torch.tensor(keep, dtype=torch.long, device=device)
            cache.keep_rows(rows)
            live = [live[r] for r in keep]
        tokens = torch.tensor([st.token_ids[-1] for st in live], dtype=torch.long, device=device)
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

    samples = [to_sample(st, decode) for st in states]
    return SampleOutput(prompt_token_ids=list(prompt_ids), samples=samples, seed=seed, stats=stats)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_single_request(llm, prompt, n: int = 1, *, attention: str = "auto", **kwargs) -> SampleOutput:
    """`LLM.sample`'s arguments through this reference path (validated by the engine's rules)."""
    from forklm.llm import Request

    params = Request(prompt, n=n, **kwargs).params(attention=attention)
    prompt_ids = llm.prompt_token_ids(prompt)
    llm.validate(prompt_ids, params)
    constraints = token_constraints(llm.tokenizer, llm.eos_token_ids) if params.constraint is not None else None
    return generate_single_request(llm.model, llm.decode, prompt_ids, params, llm.eos_token_ids, constraints)
