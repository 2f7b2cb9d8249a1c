"""REFERENCE CODE (the test oracle of beam search and diverse beam search; not a production path:
`LLM.beam_search` runs on the engine, forklm/sampling/beam.py).

Beam search written the slow, obvious way: every step recomputes every running beam's log-probs
from its whole token list (`logprobs_of`: no KV cache), ranks candidates as Python lists, keeps
finished hypotheses in a sorted list. The rules are transformers' `generate(num_beams=k)` (5.x)
and, for num_beam_groups > 1, its 4.x group beam search with Hamming diversity (the groups stepped
in order, each group's log-probs lowered by diversity_penalty per beam of an earlier group that
chose the token at this step). Scores are float32, as there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from forklm.sampling.params import SamplingParams
from forklm.sampling.sample_state import SampleState, check_finished


@dataclass
class _Beam:
    tokens: list[int]
    logprobs: list[float]
    score: torch.Tensor  # float32 scalar: the sum of its (penalized) log-probs
    checked: int = 0


@dataclass
class Hypothesis:
    token_ids: list[int]
    logprobs: list[float]
    score: float  # sum of log-probs / len ** length_penalty
    finish_reason: str
    stop_reason: str | int | None = None
    text: str | None = None


@dataclass
class _Group:
    width: int
    running: list[_Beam]
    finished: list[tuple[float, Hypothesis]] = field(default_factory=list)
    improvable: bool = True
    done: bool = False


def beam_search_reference(
    logprobs_of: Callable[[list[list[int]]], torch.Tensor],  # token lists (prompt + beam) -> [b, V] log-softmax
    prompt_ids: list[int],
    params: SamplingParams,
    stop_ids: set[int],
    decode: Callable[[list[int]], str],
) -> list[Hypothesis]:
    """The n best hypotheses, best score first."""
    G = params.num_beam_groups
    width = params.beam_width // G
    zero = torch.zeros((), dtype=torch.float32)
    groups = [_Group(width, [_Beam([], [], zero)]) for _ in range(G)]
    lp_pow = params.length_penalty
    while not all(g.done for g in groups):
        chosen: list[int] = []  # this step's tokens of the groups stepped so far
        for g in groups:
            if g.done:
                continue
            gen = len(g.running[0].tokens)
            rows = logprobs_of([prompt_ids + b.tokens for b in g.running]).to(torch.float32)
            adjusted = rows.clone()
            if gen < params.min_tokens:
                for t in stop_ids:
                    adjusted[:, t] = float("-inf")
            for t in chosen:
                adjusted[:, t] -= params.diversity_penalty
            if params.beam_width == 1:
                K = 1
            else:
                K = max(2, 1 + len(stop_ids)) * width
            cands = []  # (accumulated score, beam, token)
            for b, beam in enumerate(g.running):
                acc = adjusted[b] + beam.score
                vals, toks = torch.topk(acc, K)
                cands += [(v, b, t) for v, t in zip(vals, toks.tolist())]
            cands.sort(key=lambda c: -float(c[0]))
            cands = cands[:K]
            states = []
            for v, b, t in cands:
                parent = g.running[b]
                st = SampleState(0)
                st.token_ids = parent.tokens + [t]
                st.logprobs = parent.logprobs + [float(rows[b, t])]
                st.checked = parent.checked
                hit = check_finished(st, params, stop_ids, decode)
                states.append((st, hit))
            # finished: stopping candidates among the `width` best
            for (v, b, t), (st, hit) in list(zip(cands, states))[:width]:
                if not hit:
                    continue
                full = len(g.finished) == width and params.early_stopping is True
                if full or not g.improvable:
                    continue
                norm = float(v / ((gen + 1) ** lp_pow))
                g.finished.append((norm, Hypothesis(st.token_ids, st.logprobs, norm, st.finish_reason,
                                                    st.stop_reason, st.text)))
            g.finished.sort(key=lambda x: -x[0])
            del g.finished[width:]
            # running: the best candidates that did not stop
            nxt = [(v, st) for (v, b, t), (st, hit) in zip(cands, states) if not hit][:width]
            g.running = [_Beam(st.token_ids, st.logprobs, v, st.checked) for v, st in nxt]
            chosen += [st.token_ids[-1] for _, st in nxt]
            if len(g.finished) == width and g.running:
                longest = params.max_tokens if params.early_stopping == "never" and lp_pow > 0 else gen + 1
                best = float(g.running[0].score / (longest ** lp_pow))
                g.improvable = g.improvable and best > min(s for s, _ in g.finished)
            g.done = (not g.improvable or (len(g.finished) == width and params.early_stopping is True)
                      or all(hit for _, hit in states) or not g.running)
            if g.done:
                chosen = chosen[: len(chosen) - len(nxt)]  # a finished group's beams choose nothing
    hyps = [h for g in groups for _, h in g.finished]
    hyps.sort(key=lambda h: -h.score)
    return hyps[: params.n]
