"""The output processor: one batch of sampling arguments per step, the draw, stop rules, events.

It reads the step's logits, draws every sample's next token in one batched draw (rows grouped by
their sampling parameters, each row's randomness from (seed, sample, position): the same token
whatever the batch), applies the stop rules (`sampling/sample_state.py`), and emits one
`TokenEvent` per new token. A constrained request's samples get their grammar matchers here, at
their first draw (`sampling/constraints.py`, bound to the engine's tokenizer); the masks of the
rows that will draw are computed on a worker thread while the model runs (`prepare`). It never
touches blocks: it reports which prompts completed, which sequences finished and which requests
failed, and the engine hands those to the KV manager.

Jump-forward: after a constrained sample's drawn token, the run its grammar forces next becomes
the sample's known tokens (`SampleState.ahead`, consumed by its matcher) and joins its sequence;
the scheduler extends the sequence by the drawn token and the whole run in the next step, whose
logits give each known token its log-prob (the row before it) before it becomes a sample token,
with the stop rules and an event each, and the row of the run's last token gives the next draw.

Failures are isolated per request: a stop check or final decode that raises (e.g. a tokenizer
that cannot decode an id) fails that request only; a failing batched draw fails the requests of
this step only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from forklm.engine.model_runner import StepOutput
from forklm.engine.request import RequestState, Sequence, TokenEvent
from forklm.engine.scheduler import ScheduledBatch
from forklm.errors import InvalidArgumentError, ModelOutputError
from forklm.sampling.constraints import MaskWorker, token_constraints
from forklm.sampling.sample_state import (
    SampleState,
    accept_ahead,
    check_finite,
    check_finished,
    draw_rows,
    draw_tokens,
    jump_forward,
    stop_token_set,
    to_sample,
)
from forklm.sampling.sampler import model_logprobs
from forklm.sampling.seeds import counter_uniforms
from forklm.speculative.draft_model import accept_seed, recover_seed
from forklm.speculative.verify import accepted_prefix, rejection_sample, target_probs
from forklm.tokenizer import Tokenizer


@dataclass
class StepResult:
    touched: list[RequestState] = field(default_factory=list)  # requests that got tokens (or failed) this step
    prompts_done: list[RequestState] = field(default_factory=list)  # prompts whose prefill completed
    finished_seqs: list[Sequence] = field(default_factory=list)  # samples that ended (blocks to release)
    failed: dict[int, tuple[RequestState, BaseException]] = field(default_factory=dict)  # id(req) -> (req, error)
    sample_ended: dict[int, RequestState] = field(default_factory=dict)  # requests a sample of which ended
    rolled_back: list[Sequence] = field(default_factory=list)  # verified drafts: blocks past `keep_blocks` go back
    beam_forks: list[tuple[Sequence, SampleState]] = field(default_factory=list)  # (parent, child) to fork

    def fail(self, req: RequestState, exc: BaseException) -> None:
        self.failed.setdefault(id(req), (req, exc))


class OutputProcessor:
    def __init__(self, decode: Callable[[list[int]], str], eos_token_ids: tuple[int, ...], speculator=None) -> None:
        self.decode = decode
        self.speculator = speculator
        self.eos_token_ids = eos_token_ids
        # the engine is handed its tokenizer's bound `decode`; constraints need that vocabulary
        tokenizer = getattr(decode, "__self__", None)
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else None
        self.masks = MaskWorker()

    def prepare(self, batch: ScheduledBatch) -> None:
        """Starts computing the grammar masks of the constrained rows that will draw this step (on
        a worker thread, while the forward runs; `process` waits for them)."""
        matchers = []
        for seq in batch.decode + batch.extend:
            m = seq.sample.matcher if seq.sample is not None else None
            if m is not None:
                matchers.append(m)
        if matchers:
            self.masks.start(matchers)

    def wait(self) -> None:
        """Waits for masks started by `prepare` (before anything else touches the matchers)."""
        self.masks.wait()

    def process(self, batch: ScheduledBatch, out: StepOutput) -> StepResult:
        self.masks.wait()
        result = StepResult()
        # the drawn states: the logits row of each, its sequence and its request
        rows, states, seqs, owner, touched = self._drawing_rows(batch, out, result)
        if batch.extend:
            self._process_extends(batch, out, result, touched, rows, states, seqs, owner)
        result.touched = list(touched.values())
        if not states:
            if batch.extend:
                self._count(result.touched, [], out.shared_reads)
            return result
        self._prepare_requests(result)
        if result.failed:
            keep = [i for i, r in enumerate(owner) if id(r) not in result.failed]
            rows, states, seqs, owner = ([x[i] for i in keep] for x in (rows, states, seqs, owner))
            if not states:
                return result
        beam_owner: list[RequestState] = []
        if any(r.beam is not None for r in owner):
            rows, states, seqs, owner, beam_owner = self._beam_rows(out, rows, states, seqs, owner, result)
            if not states:
                self._count(result.touched, beam_owner, out.shared_reads)
                return result
        if not self._draw(out, rows, states, owner, result):
            return result
        self._count(result.touched, owner + beam_owner, out.shared_reads)
        self._finish_draws(seqs, states, owner, result)
        return result

    def _drawing_rows(self, batch: ScheduledBatch, out: StepOutput, result: StepResult) -> tuple[
            list[int], list[SampleState], list[Sequence | None], list[RequestState], dict[int, RequestState]]:
        """The states that draw from the step's decode rows and chunk rows (rows, states, seqs,
        owner, as below) and the requests touched (id -> request). A prompt whose last chunk ran
        is reported done, and its fresh samples all draw from its last row."""
        row_of_seq = out.row_of_seq
        dec = batch.decode
        rows: list[int]  # logits row of each drawn state
        states: list[SampleState]
        seqs: list[Sequence | None]  # None: a sample's first token, from its prompt's logits
        owner: list[RequestState]  # the request of each drawn state
        if all(seq.sample is not None for seq in dec):  # decode rows of samples (the common case)
            rows = [row_of_seq[id(seq)] for seq in dec]
            states = [seq.sample for seq in dec]
            seqs = list(dec)
            owner = [seq.request for seq in dec]
            touched = {id(r): r for r in owner}
            rest = [c[0] for c in batch.chunks]
        else:
            rows, states, seqs, owner, touched = [], [], [], [], {}
            rest = dec + [c[0] for c in batch.chunks]
        for seq in rest:
            row = row_of_seq.get(id(seq))
            if row is None:
                continue
            req = seq.request
            touched[id(req)] = req
            if seq.sample is None:
                result.prompts_done.append(req)
                fresh = [st for st in req.samples if not st.token_ids]
                rows += [row] * len(fresh)
                states += fresh
                seqs += [None] * len(fresh)
                owner += [req] * len(fresh)
            else:
                rows.append(row)
                states.append(seq.sample)
                seqs.append(seq)
                owner.append(req)
        return rows, states, seqs, owner, touched

    def _process_extends(self, batch: ScheduledBatch, out: StepOutput, result: StepResult,
                         touched: dict[int, RequestState], rows: list[int], states: list[SampleState],
                         seqs: list[Sequence | None], owner: list[RequestState]) -> None:
        """The step's extends: drafted ones are verified, known runs accepted; the sequences that
        go on to draw from their last row join the drawn states (`rows` ... `owner`, in place)."""
        row_of_seq = out.row_of_seq
        for seq in batch.extend:
            touched[id(seq.request)] = seq.request
        result.touched = list(touched.values())
        drafted = [seq for seq in batch.extend if seq.draft]
        known = [seq for seq in batch.extend if not seq.draft] if drafted else batch.extend
        if drafted:
            self._verify_drafts(drafted, out, result)
        _, drawing = self._accept_known(known, out, result) if known else (0, [])
        for seq in drawing:
            rows.append(row_of_seq[id(seq)])
            states.append(seq.sample)
            seqs.append(seq)
            owner.append(seq.request)

    def _beam_rows(self, out: StepOutput, rows: list[int], states: list[SampleState], seqs: list[Sequence | None],
                   owner: list[RequestState], result: StepResult) -> tuple[list, ...]:
        """Beam search requests' rows: each beam's log-softmax row goes to its request's
        `BeamSearch`; a request whose live beams all have theirs takes its beam step. Returns the
        other rows (rows, states, seqs, owner) and the owner of each beam row."""
        mine = [i for i, r in enumerate(owner) if r.beam is not None]
        keep = [i for i, r in enumerate(owner) if r.beam is None]
        beam_owner = [owner[i] for i in mine]
        rest = tuple([x[i] for i in keep] for x in (rows, states, seqs, owner))
        try:
            idx = torch.tensor([rows[i] for i in mine], dtype=torch.long, device=out.logits.device)
            lps = torch.log_softmax(out.logits.index_select(0, idx).float(), dim=-1).cpu()
        except Exception as exc:  # noqa: BLE001 - these requests fail, the others draw
            for r in beam_owner:
                result.fail(r, exc)
            return (*rest, [])
        stepping: dict[int, RequestState] = {}
        for j, i in enumerate(mine):
            r = owner[i]
            r.beam.add_row(states[i], lps[j])
            stepping[id(r)] = r
        for r in stepping.values():
            if r.beam.ready():
                try:
                    self._beam_step(r, result)
                except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that cannot decode: this request fails
                    result.fail(r, exc)
        return (*rest, beam_owner)

    def _beam_step(self, req: RequestState, result: StepResult) -> None:
        """The request's next beams: a parent's first child continues in the parent's sequence, its
        further children fork from it (`result.beam_forks`: blocks shared by the engine's KV
        manager), parents without children end; children of a parent without KV (preempted, or
        the prompt itself at the first step) wait to be computed. Once the search is done, the
        request's samples are its hypotheses."""
        beam = req.beam
        for st in beam.live:
            row = beam.rows[st]
            if bool(torch.isnan(row).any()) or not bool(torch.isfinite(row.max())):
                raise ModelOutputError(f"the model's logits for beam {st.index} at generated token "
                                       f"{len(st.token_ids) + 1} are not finite (NaN, +inf or only -inf): the "
                                       "beam search stops")
        children = beam.step(req.stop_ids, self.decode)
        if beam.done:
            req.samples = beam.result()
            result.sample_ended[id(req)] = req  # no sample is unfinished: the engine finishes it
            return
        seq_of = {id(seq.sample): seq for seq in req.running}
        continued: set[int] = set()
        pending = []
        for ch in children:
            seq = seq_of.get(id(ch.parent))
            if seq is None:
                pending.append(ch.state)
            elif id(seq) not in continued:
                continued.add(id(seq))
                seq.sample = ch.state
                seq.tokens.append(ch.state.token_ids[-1])
            else:
                result.beam_forks.append((seq, ch.state))
        result.finished_seqs.extend(seq for seq in req.running if id(seq) not in continued)
        req.samples = [ch.state for ch in children]
        req.pending = pending

    def _prepare_requests(self, result: StepResult) -> None:
        """Stop ids and (at a constrained request's first draw) grammar matchers of the touched
        requests; a request whose matchers cannot be made fails, the others draw."""
        for r in result.touched:
            if r.stop_ids is None:
                r.stop_ids = stop_token_set(r.params, self.eos_token_ids)
            if r.params.constraint is not None and r.samples[0].matcher is None:
                try:
                    self._start_matchers(r)
                except Exception as exc:  # noqa: BLE001 - this request fails, the others draw
                    result.fail(r, exc)

    @staticmethod
    def _draw(out: StepOutput, rows: list[int], states: list[SampleState], owner: list[RequestState],
              result: StepResult) -> bool:
        """One batched draw of every state from its logits row; False if it failed (then this
        step's requests fail)."""
        try:
            if rows == list(range(out.logits.shape[0])):  # each row drawn once, in order: no copy
                picked = out.logits
            else:
                picked = out.logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=out.logits.device))
            draw_rows(picked, states, [r.params for r in owner], [r.seed for r in owner], [r.stop_ids for r in owner])
        except Exception as exc:  # noqa: BLE001 - the whole draw failed: this step's requests fail
            for r in result.touched:
                result.fail(r, exc)
            return False
        return True

    def _finish_draws(self, seqs: list[Sequence | None], states: list[SampleState], owner: list[RequestState],
                      result: StepResult) -> None:
        """After the draw: the stop rules, the grammar's forced run (jump-forward) appended to the
        sequence with the drawn token, and an event per drawn token."""
        failed = result.failed
        decode = self.decode
        for seq, st, r in zip(seqs, states, owner):
            if failed and id(r) in failed:
                continue
            try:
                check_finite(st)
                fin = check_finished(st, r.params, r.stop_ids, decode)
                sample = to_sample(st, decode) if fin else None
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that cannot decode: this request fails
                result.fail(r, exc)
                continue
            if fin:
                result.sample_ended[id(r)] = r
                if seq is not None:
                    result.finished_seqs.append(seq)
            else:
                try:
                    run = jump_forward(st, r.params)  # the grammar's forced run, computed next step
                except Exception as exc:  # noqa: BLE001 - a matcher failure: this request fails
                    result.fail(r, exc)
                    continue
                if seq is not None:
                    seq.tokens.append(st.token_ids[-1])
                    if run:
                        seq.tokens.extend(run)
            if r.on_event is not None:
                emit(r, TokenEvent(r.request_id, st.index, st.token_ids[-1], st.logprobs[-1],
                                   st.finish_reason if fin else None,
                                   st.top_logprobs[-1] if st.top_logprobs else None, sample))

    def _accept_known(self, extend: list[Sequence], out: StepOutput, result: StepResult) -> tuple[int, list[Sequence]]:
        """The known tokens of the step's extends become sample tokens, each with its log-prob
        from the row before it, the stop rules and an event; returns how many became tokens and
        the sequences that go on to draw from their last row (those that did not end)."""
        rows: list[int] = []
        toks: list[int] = []
        for seq in extend:
            ahead = seq.sample.ahead
            last = out.row_of_seq[id(seq)]
            rows.extend(range(last - len(ahead), last))
            toks.extend(ahead)
        dev = out.logits.device
        picked = out.logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev))
        lps = model_logprobs(picked, torch.tensor(toks, dtype=torch.long, device=dev)).tolist()
        top = _top_logprobs(picked, extend)
        drawing, accepted, at = [], 0, 0
        failed = result.failed
        for seq in extend:
            st, r = seq.sample, seq.request
            span = range(at, at + len(st.ahead))
            at += len(st.ahead)
            if failed and id(r) in failed:
                continue
            kt = r.params.top_logprobs
            fin = False
            try:
                for j in span:
                    accept_ahead(st, lps[j], top[j][:kt] if kt else None)
                    check_finite(st)
                    accepted += 1
                    r.stats.generated_tokens += 1
                    fin = check_finished(st, r.params, r.stop_ids, self.decode, forced=True)
                    sample = to_sample(st, self.decode) if fin else None
                    if r.on_event is not None:
                        emit(r, TokenEvent(r.request_id, st.index, st.token_ids[-1], st.logprobs[-1],
                                           st.finish_reason if fin else None,
                                           st.top_logprobs[-1] if kt else None, sample))
                    if fin:
                        break
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that cannot decode: this request fails
                result.fail(r, exc)
                continue
            if fin:
                st.ahead = []
                result.sample_ended[id(r)] = r
                result.finished_seqs.append(seq)
            else:
                drawing.append(seq)
        return accepted, drawing

    def _verify_drafts(self, seqs: list[Sequence], out: StepOutput, result: StepResult) -> None:
        """Speculative verification of the drafted sequences (`forklm/speculative/verify.py`).

        Each sequence ran its pending token and its k draft tokens as k + 1 rows; row j's logits
        give the token at the sample's position t + j. The target draws its own token at every
        row exactly as decoding would (`draw_tokens`: same parameters, same uniform of (seed,
        sample, t + j)); the draft's leading tokens equal to the drawn ones are accepted, and the
        first drawn token that differs (or the bonus after a whole draft) is emitted after them.
        So the sample's tokens are the drawn ones: identical to non-speculative decoding. Each
        emitted token gets its log-prob from its row, the stop rules and an event; the sequence
        is cut back to its verified tokens (its computed count too) and reported for rollback."""
        t0 = time.perf_counter()
        failed = result.failed
        live = [seq for seq in seqs if not (failed and id(seq.request) in failed)]
        if not live:
            return
        columns = self._verify_columns(live, out)
        try:
            sampled, drawn, lps, top = self._draw_verified(live, out, *columns)
        except Exception as exc:  # noqa: BLE001 - the verification draw failed: these requests fail
            for seq in live:
                result.fail(seq.request, exc)
            return
        drafted, accepted, emitted = self._accept_verified(live, sampled, drawn, lps, top, result)
        if self.speculator is not None and drafted:
            self.speculator.observe(drafted, accepted, emitted, time.perf_counter() - t0)

    def _verify_columns(self, live: list[Sequence], out: StepOutput) -> tuple[list, ...]:
        """Per verified row (k + 1 per drafted sequence, in order): its logits row, sampling
        parameters, seed, sample index, position and stop ids (`draw_tokens`'s arguments)."""
        rows: list[int] = []
        params, seeds, indices, steps, stops = [], [], [], [], []
        for seq in live:
            st, r = seq.sample, seq.request
            if r.stop_ids is None:
                r.stop_ids = stop_token_set(r.params, self.eos_token_ids)
            k = len(seq.draft)
            last = out.row_of_seq[id(seq)]
            t = len(st.token_ids)
            rows.extend(range(last - k, last + 1))
            params += [r.params] * (k + 1)
            seeds += [r.seed] * (k + 1)
            indices += [st.index] * (k + 1)
            steps.extend(range(t, t + k + 1))
            stops += [r.stop_ids] * (k + 1)
        return rows, params, seeds, indices, steps, stops

    def _draw_verified(self, live: list[Sequence], out: StepOutput, rows: list[int], params, seeds, indices,
                       steps, stops) -> tuple[dict[int, int], list[int], list[float], list | None]:
        """The target's tokens at the verified rows (sampled drafts by rejection sampling), their
        log-probs and top log-probs: (id(seq) -> accepted count of sampled drafts, drawn, lps, top)."""
        picked = out.logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=out.logits.device))  # [R, V]
        drawn_t = draw_tokens(picked, params, seeds, indices, steps, stops)  # [R]
        sampled = self._rejection_sample(live, picked, drawn_t, params, steps, stops)
        lps = model_logprobs(picked, drawn_t).tolist()
        drawn = drawn_t.tolist()
        return sampled, drawn, lps, _top_logprobs(picked, live)

    def _accept_verified(self, live: list[Sequence], sampled: dict[int, int], drawn: list[int], lps: list[float],
                         top: list | None, result: StepResult) -> tuple[list[int], list[int], list[int]]:
        """Emits each sequence's accepted draft tokens and the drawn one after them (stop rules,
        log-probs, events) and cuts the sequence back to its verified tokens; returns the drafted,
        accepted and emitted counts of the sequences verified."""
        drafted, accepted, emitted = [], [], []
        at = 0
        failed = result.failed
        decode = self.decode
        for seq in live:
            st, r = seq.sample, seq.request
            k = len(seq.draft)
            span = range(at, at + k + 1)
            at += k + 1
            if failed and id(r) in failed:
                continue
            a = sampled[id(seq)] if id(seq) in sampled else accepted_prefix(seq.draft, drawn[span.start : span.stop])
            base = seq.num_computed - k  # tokens through the pending one (whose KV this step computed)
            kt = r.params.top_logprobs
            fin, m = False, 0
            try:
                for j in span[: a + 1]:
                    st.token_ids.append(drawn[j])
                    st.logprobs.append(lps[j])
                    check_finite(st)
                    if kt:
                        if st.top_logprobs is None:
                            st.top_logprobs = []
                        st.top_logprobs.append(top[j][:kt])
                    m += 1
                    r.stats.generated_tokens += 1
                    fin = check_finished(st, r.params, r.stop_ids, decode)
                    sample = to_sample(st, decode) if fin else None
                    if r.on_event is not None:
                        emit(r, TokenEvent(r.request_id, st.index, drawn[j], lps[j], st.finish_reason if fin else None,
                                           st.top_logprobs[-1] if kt else None, sample))
                    if fin:
                        break
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer that cannot decode: this request fails
                result.fail(r, exc)
                continue
            # the sequence keeps its verified tokens only: the pending one, then the emitted ones,
            # of which those equal to draft tokens have their KV computed (the last one is pending)
            del seq.tokens[base:]
            seq.tokens.extend(st.token_ids[len(st.token_ids) - m :])
            seq.num_computed = base + min(m, a)
            seq.draft_computed = min(seq.draft_computed, seq.num_computed)  # a draft model's KV past it: rejected tokens
            seq.draft = []
            seq.draft_probs = None
            result.rolled_back.append(seq)
            drafted.append(k)
            accepted.append(a)
            emitted.append(m)
            if fin:
                result.sample_ended[id(r)] = r
                result.finished_seqs.append(seq)
        return drafted, accepted, emitted

    @staticmethod
    def _rejection_sample(live: list[Sequence], picked: torch.Tensor, drawn: torch.Tensor, params, steps, stops) -> dict[int, int]:
        """Sampled drafts (a draft model drawing from q, `seq.draft_probs` [k, V]): modified
        rejection sampling against the target's distribution p at each row (its temperature,
        top-k, top-p and min_tokens ban), with counter-based uniforms of (seed, sample,
        position) on streams of their own (acceptance; the recovered or bonus draw). Writes each
        such sequence's emitted tokens into `drawn` (its draft's accepted tokens, then the
        recovered or bonus token) and returns id(seq) -> accepted count. Exact in distribution
        (the samples are distributed as without speculation), not token for token."""
        out: dict[int, int] = {}
        if not any(seq.draft_probs is not None for seq in live):
            return out
        logits = picked
        early = [r for r, t in enumerate(steps) if t < params[r].min_tokens and stops[r]]
        if early:  # as `draw_tokens`: stop ids banned before min_tokens
            logits = picked.clone()
            for r in early:
                logits[r, torch.tensor(sorted(stops[r]), dtype=torch.long, device=picked.device)] = float("-inf")
        at = 0
        for seq in live:
            k = len(seq.draft)
            span = slice(at, at + k + 1)
            at += k + 1
            if seq.draft_probs is None:
                continue
            pr = params[span.start]
            p = target_probs(logits[span], pr.temperature, pr.top_k, pr.top_p)  # [k + 1, V]
            q = seq.draft_probs.to(p)  # [k, V]
            st, r = seq.sample, seq.request
            t = steps[span.start]
            u_acc = counter_uniforms([accept_seed(r.seed)] * k, [st.index] * k, range(t, t + k))
            u_draw = counter_uniforms([recover_seed(r.seed)], [st.index], [t])
            draft = torch.tensor(seq.draft, dtype=torch.long, device=p.device)
            a, nxt = rejection_sample(p[None], q[None], draft[None], u_acc[None].to(p.device), u_draw.to(p.device))
            a = int(a[0])
            emitted = seq.draft[:a] + [int(nxt[0])] * (k + 1 - a)
            drawn[span] = torch.tensor(emitted, dtype=torch.long, device=drawn.device)
            out[id(seq)] = a
        return out

    def _start_matchers(self, req: RequestState) -> None:
        """Gives each sample of a constrained request its own matcher (at its first draw)."""
        if self.tokenizer is None:
            raise InvalidArgumentError(f"{req.params.constraint.param}: this engine has no tokenizer to constrain text with")
        constraints = token_constraints(self.tokenizer, self.eos_token_ids)
        for st, matcher in zip(req.samples, constraints.matchers(req.params.constraint, len(req.samples))):
            st.matcher = matcher

    @staticmethod
    def _count(touched: list[RequestState], owner: list[RequestState], shared_reads: int) -> None:
        """Per-request stats: generated tokens (`owner`: the request of each drawn token), decode
        steps and their wall times, paths taken."""
        now = time.perf_counter()
        path = "bifurcated" if shared_reads else "standard"
        for r in owner:
            r.stats.generated_tokens += 1
        for r in touched:
            if r.first_token_time is None:
                r.first_token_time = now
            if r.last_step_time is not None:  # a decode step (the first tokens come from the prefill's)
                stats = r.stats
                stats.steps += 1
                stats.path_steps[path] = stats.path_steps.get(path, 0) + 1
                stats.step_s.append(now - r.last_step_time)
            r.last_step_time = now


def _top_logprobs(picked: torch.Tensor, seqs: list[Sequence]) -> list | None:
    """Each row's top log-probs as [(token id, log-prob), ...], as many as the most any request of
    `seqs` asks for (each takes its own count of them); None when none asks."""
    if not any(seq.request.params.top_logprobs for seq in seqs):
        return None
    k = max(seq.request.params.top_logprobs for seq in seqs)
    values, ids = torch.topk(picked, k, dim=-1)  # picked [R, V] -> [R, k]
    values = values - torch.logsumexp(picked, dim=-1, keepdim=True)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def emit(req: RequestState, event: TokenEvent) -> None:
    """Calls the request's callback; one that raises is dropped (the request still runs)."""
    if req.on_event is None:
        return
    try:
        req.on_event(event)
    except Exception:  # noqa: BLE001 - a consumer's failure must not break the engine
        req.on_event = None
