"""Beam search over one prompt: the search's rules as state updates (no blocks, no model).

One `BeamSearch` per request. The engine hands it the log-softmax row of every live beam
(`add_row`); once every live beam has one (`ready`), `step` picks the next beams and reports
each as a `BeamChild` (its parent beam and the parent's tokens plus one). The engine turns that
into sequences: a parent's first child continues in the parent's sequence, further children
share the parent's full KV blocks by reference (`KVManager.fork_sequence`), parents without
children are released.

The rules are transformers' `generate(num_beams=k, do_sample=False)` (its `_beam_search`, 5.x),
in float32 as there, so that the same log-probs give the same beams:
- running scores start at 0 (the prompt); each step every running beam's log-probs plus its
  score make the candidates, of which the best K = max(2, 1 + #stop ids) · k are kept;
- a candidate that hits a stopping rule (a stop token or string, or max_tokens) is a finished
  hypothesis if it ranks among the best k, scored sum(log-probs) / generated_len ** length_penalty
  (its stop token counted); the k best finished are kept;
- the k best candidates that did not stop run on;
- the search ends when every candidate stops, when k hypotheses are finished and
  `early_stopping` is True, or when the best running beam cannot beat the worst of k finished
  ones (False: at its current length; "never": at max_tokens where length_penalty > 0).
min_tokens bans the stop tokens' log-probs (-inf) before that many tokens, as transformers'
`min_new_tokens`. beam_width 1 is greedy decoding (transformers' num_beams=1): one candidate a
step, the search ends when it stops.

Diverse beam search (Vijayakumar et al. 2018; transformers 4.x's group beam search, since 5.0
Hub code only): `num_beam_groups` G splits the k beams into G groups of k / G, stepped in order
at each step; group g's log-probs are lowered by `diversity_penalty` times the number of beams of
groups 0..g-1 that chose each token at this step (Hamming diversity). Each group is the search
above over its own k / G beams (its own finished hypotheses and end); the result is every
group's hypotheses, best score first. (Tested against forklm/reference/beam_search.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from forklm.sampling.params import SamplingParams
from forklm.sampling.sample_state import SampleState, check_finished

NEG = -1.0e9  # transformers' score of a beam that must not be chosen


@dataclass(frozen=True)
class BeamChild:
    parent: SampleState  # a running beam of the step
    state: SampleState  # the parent's tokens and log-probs plus the chosen token


def child_state(parent: SampleState, token: int, logprob: float, index: int) -> SampleState:
    st = SampleState(index)
    st.token_ids = parent.token_ids + [token]
    st.logprobs = parent.logprobs + [logprob]
    st.checked = parent.checked
    return st


class BeamGroup:
    """One group's running beams, their float32 scores, and its k finished hypotheses."""

    def __init__(self, width: int, first_index: int, greedy: bool = False) -> None:
        self.width = width
        self.greedy = greedy
        self.first_index = first_index  # running beam j of this group has sample index first_index + j
        self.beams: list[SampleState] = [SampleState(first_index)]  # the prompt: one beam
        self.scores = torch.zeros(1)  # [live] cumulative log-prob of each running beam
        self.finished_scores = torch.full((width,), NEG)  # [k] best first; NEG: an empty slot
        self.finished_flags = torch.zeros(width, dtype=torch.bool)
        self.finished: list[SampleState | None] = [None] * width
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False

    def step(self, logprobs: torch.Tensor, penalty: torch.Tensor | None, params: SamplingParams,
             stop_ids: set[int], decode: Callable[[list[int]], str]) -> list[BeamChild]:
        """One step from `logprobs` [live, V] (log-softmax rows of the running beams, in order);
        `penalty` [V]: subtracted from every row (diversity). Returns the running children."""
        k = self.width
        gen = len(self.beams[0].token_ids)  # tokens generated so far (every running beam has as many)
        raw = logprobs
        lp = raw
        if gen < params.min_tokens and stop_ids:
            lp = lp.clone()
            lp[:, sorted(stop_ids)] = float("-inf")
        if penalty is not None:
            lp = lp - penalty
        acc = lp + self.scores[:, None]  # [live, V]
        # beam_width 1 is greedy decoding, as transformers' num_beams=1: the best candidate only
        K = 1 if self.greedy else min(max(2, 1 + len(stop_ids)) * k, acc.numel())
        # the K best of all rows are among each row's K best: two small top-k's, not one over live * V
        row_vals, row_idx = torch.topk(acc, min(K, acc.shape[1]), dim=1)
        top_vals, top_pos = torch.topk(row_vals.reshape(-1), K)
        Kr = row_vals.shape[1]
        parents = torch.div(top_pos, Kr, rounding_mode="floor").tolist()
        tokens = row_idx.reshape(-1)[top_pos].tolist()
        raw_lps = raw[parents, tokens].tolist()
        cands = [child_state(self.beams[p], t, lp_, -1) for p, t, lp_ in zip(parents, tokens, raw_lps)]
        hit_list = [check_finished(c, params, stop_ids, decode) for c in cands]
        hits = torch.tensor(hit_list, dtype=torch.bool)

        # the running beams of the next step: the k best candidates that did not stop
        running_vals = top_vals + hits.to(torch.float32) * NEG
        nxt = torch.topk(running_vals, k).indices.tolist() if K >= k else list(range(K))
        # (fewer than k when more than K - k candidates stopped: every one at max_tokens, or stop strings
        # that many tokens complete; transformers keeps such beams at score -1e9, never to be chosen)
        nxt = [c for c in nxt if not hit_list[c]]
        children = []
        for j, c in enumerate(nxt):
            st = cands[c]
            st.index = self.first_index + j
            children.append(BeamChild(self.beams[parents[c]], st))
        new_scores = running_vals[nxt]

        # finished hypotheses: those of the k best candidates that stopped, merged with the kept ones
        just = hits & (torch.arange(K) < k)
        norm = top_vals / ((gen + 1) ** params.length_penalty)
        full = bool(self.finished_flags.all()) and params.early_stopping is True
        norm = norm + float(full) * NEG
        norm = norm + float(not self.improvable) * NEG
        norm = norm + (~just) * NEG
        merged = torch.cat((self.finished_scores, norm))
        merged_flags = torch.cat((self.finished_flags, just))
        keep = torch.topk(merged, k).indices.tolist()
        states = self.finished + cands
        self.finished_scores = merged[keep]
        self.finished_flags = merged_flags[keep]
        self.finished = [states[i] if bool(merged_flags[i]) else None for i in keep]
        for st, score in zip(self.finished, self.finished_scores.tolist()):
            if st is not None:
                st.score = score

        self.beams = [ch.state for ch in children]
        self.scores = new_scores
        gen += 1
        longest = params.max_tokens if params.early_stopping == "never" and params.length_penalty > 0.0 else gen
        if children:  # (none: the search ends below)
            best = new_scores[:1] / (longest ** params.length_penalty)
            worst = torch.where(self.finished_flags, self.finished_scores.min(), NEG)
            self.improvable = self.improvable and bool(torch.any(best > worst))
        all_finished = bool(self.finished_flags.all())
        self.done = (not self.improvable or (all_finished and params.early_stopping is True)
                     or bool(hits.all()) or not children)
        if self.done:
            self.beams = []
            return []
        return children

    def hypotheses(self) -> list[SampleState]:
        return [st for st in self.finished if st is not None]


class BeamSearch:
    """A request's beam search: its groups, the rows gathered for the next step, the result."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        G = params.num_beam_groups
        width = params.beam_width // G
        self.groups = [BeamGroup(width, g * width, greedy=params.beam_width == 1) for g in range(G)]
        self.rows: dict[SampleState, torch.Tensor] = {}  # live beam -> its log-softmax row [V]
        self.steps = 0

    @property
    def live(self) -> list[SampleState]:
        return [st for g in self.groups if not g.done for st in g.beams]

    @property
    def done(self) -> bool:
        return all(g.done for g in self.groups)

    def add_row(self, state: SampleState, logprobs: torch.Tensor) -> None:
        self.rows[state] = logprobs

    def ready(self) -> bool:
        return all(st in self.rows for st in self.live)

    def step(self, stop_ids: set[int], decode: Callable[[list[int]], str]) -> list[BeamChild]:
        """Every group's step from the gathered rows (diversity across groups in order); returns
        the next running beams (none once the search is done)."""
        children: list[BeamChild] = []
        penalty = None
        lam = self.params.diversity_penalty
        for g in self.groups:
            if g.done:
                continue
            rows = torch.stack([self.rows[st] for st in g.beams])
            group_children = g.step(rows, penalty if lam > 0 else None, self.params, stop_ids, decode)
            children += group_children
            if lam > 0 and group_children:
                chosen = torch.tensor([ch.state.token_ids[-1] for ch in group_children], dtype=torch.long)
                counts = torch.bincount(chosen, minlength=rows.shape[1]).to(torch.float32)
                penalty = counts * lam if penalty is None else penalty + counts * lam
        self.rows.clear()
        self.steps += 1
        return children

    def result(self) -> list[SampleState]:
        """The n best hypotheses of every group, best score first, as finished samples 0..n-1."""
        hyps = [st for g in self.groups for st in g.hypotheses()]
        hyps.sort(key=lambda st: -st.score)  # stable: group order among equal scores
        best = hyps[: self.params.n]
        for i, st in enumerate(best):
            st.index = i
        return best

    def running_as_result(self, reason: str) -> list[SampleState]:
        """A search cut short (cancelled): the finished hypotheses, else the running beams so far."""
        hyps = [st for g in self.groups for st in g.hypotheses()]
        for g in self.groups:
            for st, score in zip(g.beams, g.scores.tolist()):
                if st.finish_reason is None:
                    st.finish_reason = reason
                gen = max(len(st.token_ids), 1)
                st.score = score / gen ** self.params.length_penalty
                hyps.append(st)
        hyps.sort(key=lambda st: -(st.score if st.score is not None else float("-inf")))
        best = hyps[: self.params.n]
        for i, st in enumerate(best):
            st.index = i
        return best
