"""A drafter with weights: a smaller model with the target's tokenizer drafts k tokens per sequence.

The draft model has its own paged KV *in the same engine*: a twin `PagedKVCache` for its layers,
addressed by the same block ids as the target's. Every block the pool hands out has a draft
twin, so allocation, the sharing of prompt blocks among a request's samples, prefix caching,
preemption and trimming all follow the target's block tables (the draft's prompt KV is stored
once for the n samples too). The KV manager copies the twin's slots with the target's (the
partial last prompt block of each sample) and inserts into the radix cache only blocks whose
draft KV exists too (`Sequence.draft_computed`).

Per sequence, `Sequence.draft_computed` counts the leading tokens whose draft KV is valid:
- prompt chunks (and a sample's recompute chunks) are run by the draft as the target runs them
  (`mirror`), so a finished prompt has its draft KV and every sample starts with it;
- a sample's decode rows are not mirrored: the draft lags the target by the tokens decoded or
  accepted since its last draft, and catches up in the first draft step (those tokens and the
  pending one as one extend, `ModelRunner`'s multi-token rows: shared prompt blocks read once);
- then k - 1 more autoregressive steps, one decode row per drafting sequence. The scheduler
  reserves the target's slots for 1 + k tokens before the draft writes any (draft KV goes to
  positions t .. t + k - 1 of the sequence, t its pending token's);
- verification cuts `draft_computed` back to the verified count (`min` with `num_computed`):
  KV of rejected draft tokens lies beyond it and is overwritten later, never read.

Draws: `temperature == 0`: the draft's argmax (a point mass; verification by the target's own
draw keeps the output token for token that of decoding without speculation). `temperature > 0`:
the draft draws from q (temperature, top-p) with counter-based uniforms of (seed, sample,
position) on a stream of its own, and keeps q's rows for modified rejection sampling
(`verify.rejection_sample`): exact in distribution, not token for token.
"""

from __future__ import annotations

from typing import Any

import torch

from forklm.attention.paged import StepPlanner
from forklm.backend import Backend
from forklm.cache.paged_kv import PagedKVCache
from forklm.engine.model_runner import ModelRunner
from forklm.engine.request import Sequence
from forklm.engine.scheduler import ScheduledBatch
from forklm.errors import InvalidArgumentError
from forklm.models.llama import LlamaModel
from forklm.models.loading import load_model
from forklm.sampling.sampler import nucleus_mask
from forklm.sampling.seeds import counter_uniforms, splitmix64

# streams of counter-based uniforms beside decoding's (seed, sample, position): the seed mixed
# with a constant, so a sampled draft and its verification never reuse the target's uniforms
DRAFT_STREAM, ACCEPT_STREAM, RECOVER_STREAM = 0xD1AF7, 0xACCE97, 0x2EC0BE2


def load_draft_model(draft: Any, target: Backend, quantize: str | None = "auto"):
    """(LlamaModel, tokenizer or None) of a `draft_model` value: a loaded LLM or LlamaModel, or
    anything `LLM()` loads (loaded here on the target's device and dtype, `quantize` as asked of it)."""
    if isinstance(draft, LlamaModel):
        model, tokenizer = draft, None
    elif isinstance(getattr(draft, "model", None), LlamaModel):  # an LLM
        model, tokenizer = draft.model, draft.tokenizer
    elif isinstance(draft, str):
        loaded = load_model(draft, dtype=target.dtype, device=target.device, quantize=quantize)
        model, tokenizer = loaded.model, loaded.tokenizer
    else:
        raise InvalidArgumentError(
            f"speculative draft_model must be a model path or name, an LLM or a LlamaModel, got {type(draft).__name__}")
    if model.device != target.device or model.dtype != target.dtype:
        raise InvalidArgumentError(
            f"speculative draft_model runs on {model.device} in {model.dtype}, the target on {target.device} in "
            f"{target.dtype}: load it with the target's device and dtype")
    return model, tokenizer


def _vocab(tokenizer) -> dict[str, int] | None:
    backend = getattr(tokenizer, "_tok", None)
    return backend.get_vocab(with_added_tokens=True) if backend is not None else None


def check_same_vocabulary(target: LlamaModel, target_tokenizer, draft: LlamaModel, draft_tokenizer) -> None:
    """Refuses a draft whose token ids mean other tokens than the target's: the tokenizers'
    vocabularies must be equal (ids included); for a model without a tokenizer (random:
    weights) the vocabulary sizes only."""
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise InvalidArgumentError(f"speculative draft_model has a vocabulary of {vd} ids, the target {vt}: "
                                   "the draft must use the target's tokenizer")
    if target_tokenizer is None or draft_tokenizer is None:
        return
    a, b = _vocab(target_tokenizer), _vocab(draft_tokenizer)
    if a is None or b is None or a == b:
        return
    differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    ex = ", ".join(f"{tok!r}: {i}" for tok, i in differ[:3])
    raise InvalidArgumentError(
        f"speculative draft_model's tokenizer differs from the target's: {len(a)} vs {len(b)} tokens, "
        f"{len(differ)} (token, id) pairs not in both (e.g. {ex}); the draft must use the target's tokenizer")


class _View:
    """A sequence as the draft sees it: `tokens` known, draft KV computed for `num_computed`."""

    __slots__ = ("request", "tokens", "block_table", "num_computed", "seq")

    def __init__(self, seq: Sequence, end: int, computed: int) -> None:
        self.seq, self.request, self.block_table = seq, seq.request, seq.block_table
        self.tokens = seq.tokens[:end]
        self.num_computed = computed


class DraftModelDrafter:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, shared_attention: str,
                 decode_kernel: str, vocab: int, temperature: float = 0.0, top_p: float = 1.0) -> None:
        self.model = model
        self.kv = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device)
        cfg = model.config
        planner = StepPlanner(block_size, shared_attention, model.device, decode_kernel, cfg.num_heads, cfg.num_kv_heads,
                              self.kv.num_slots)
        self.runner = ModelRunner(model, self.kv, planner)
        self.vocab = vocab
        self.temperature, self.top_p = float(temperature), float(top_p)

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def mirror(self, seqs: list[tuple[Sequence, int]]) -> None:
        """The draft computes what the target just computed for these sequences (prompt chunks,
        recompute chunks: (sequence, first token the target computed); it computed through
        `num_computed`)."""
        views = []
        for seq, s0 in seqs:
            start, end = min(seq.draft_computed, s0), seq.num_computed
            if start < end:
                views.append((_View(seq, end, start), start, end))
        if not views:
            return
        self.runner.run(ScheduledBatch(chunks=views))
        for v, _, end in views:
            v.seq.draft_computed = end

    def draft(self, plan: list[tuple[Sequence, int]]) -> list[list[int]]:
        """k draft tokens for each (sequence, k) (its pending token last in `tokens`, slots held
        through position pending + k); sampled drafts leave q's rows on `seq.draft_probs` [k, V]."""
        views, ks = [], []
        for seq, k in plan:
            t = seq.num_computed  # the pending token's position
            views.append(_View(seq, t + 1, min(seq.draft_computed, t)))
            ks.append(k)
        drafts: list[list[int]] = [[] for _ in plan]
        probs: list[list[torch.Tensor]] = [[] for _ in plan]
        try:
            for j in range(max(ks)):
                live = [i for i, k in enumerate(ks) if k > j]
                batch = ScheduledBatch(extend_logits_last_only=True)  # a catch-up needs its last row's logits only
                for i in live:
                    (batch.decode if views[i].num_computed == len(views[i].tokens) - 1 else batch.extend).append(views[i])
                out = self.runner.run(batch)
                rows = torch.tensor([out.row_of_seq[id(views[i])] for i in live], dtype=torch.long, device=out.logits.device)
                logits = out.logits.index_select(0, rows)[:, : self.vocab]  # [len(live), V]
                toks, q = self._draw(logits, [views[i] for i in live])
                for r, (i, tok) in enumerate(zip(live, toks)):
                    drafts[i].append(tok)
                    views[i].tokens.append(tok)
                    if q is not None:
                        probs[i].append(q[r])
        finally:
            for v in views:
                self.runner.forget(v)
        for (seq, _), v, d, q in zip(plan, views, drafts, probs):
            seq.draft_computed = v.num_computed  # pending .. d_{k-1}: t + k
            seq.draft_probs = torch.stack(q) if q else None
        return drafts

    def _draw(self, logits: torch.Tensor, views: list[_View]) -> tuple[list[int], torch.Tensor | None]:
        """Greedy: argmax. Sampled: a draw from q (temperature, top-p) with the uniform of
        (seed on the draft's stream, sample, position of the drawn token); returns q too."""
        if not self.sampled:
            return logits.argmax(dim=-1).tolist(), None
        q = torch.softmax(logits.double() / self.temperature, dim=-1)  # [b, V]
        if self.top_p < 1.0:
            q = q * nucleus_mask(q.float(), self.top_p)
            q = q / q.sum(-1, keepdim=True)
        u = counter_uniforms([draft_seed(v.request.seed) for v in views], [v.seq.sample.index for v in views],
                             [len(v.tokens) - len(v.request.prompt_ids) for v in views])
        cum = torch.cumsum(q, dim=-1)
        idx = torch.searchsorted(cum, (u.to(q.device) * cum[:, -1]).unsqueeze(1), right=True).squeeze(1)
        idx = idx.clamp_max(q.shape[-1] - 1)
        return idx.tolist(), q


def _stream(seed: int, stream: int) -> int:
    return splitmix64((seed ^ stream) & 0xFFFFFFFFFFFFFFFF)


def draft_seed(seed: int) -> int:
    """The seed of a sampled draft's own draws (never the target's uniforms)."""
    return _stream(seed, DRAFT_STREAM)


def accept_seed(seed: int) -> int:
    """The seed of rejection sampling's acceptance uniforms."""
    return _stream(seed, ACCEPT_STREAM)


def recover_seed(seed: int) -> int:
    """The seed of rejection sampling's recovered / bonus draws."""
    return _stream(seed, RECOVER_STREAM)
