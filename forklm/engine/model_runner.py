"""The model runner: builds one step's input tensors and attention plan, runs the model.

Rows of the forward are `[decode rows | extend rows | chunk 0 | chunk 1 | ...]`; logits are
computed for the rows whose token is a sequence's last (decode rows, and chunks that end a
sequence) and for every row of an extend (its last only with `extend_logits_last_only`: a draft
model catching up).

A multi-token extend (a running sequence computes its k pending tokens in one step: a run its
grammar forces, later a draft to verify) is k decode rows of the attention plan at consecutive
positions of the same block table: each row attends to the sequence's tokens up to its own
position (causal among the k, their K/V written before any is read), and the planner reads the
shared prompt blocks once for all rows that list them, the k included, and the k rows' own tail
as one masked read (one unit of k·p query rows per KV head). Its logits rows are consecutive,
the last one at `row_of_seq`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forklm.attention.paged import DecodeRow, PagedAttention, StepPlanner
from forklm.cache.paged_kv import PagedKVCache
from forklm.engine.scheduler import ScheduledBatch
from forklm.models.llama import LlamaModel


@dataclass
class StepOutput:
    logits: torch.Tensor  # [rows with logits, V] float32
    row_of_seq: dict[int, int]  # id(sequence) -> its logits row
    shared_reads: int  # shared-segment reads done once for several rows (bifurcated)
    num_tokens: int = 0  # tokens run through the model


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: PagedKVCache, planner: StepPlanner) -> None:
        self.model = model
        self.kv = kv
        self.planner = planner

    def run(self, batch: ScheduledBatch) -> StepOutput:
        """One forward over the batch; the sequences' computed counts advance only if it succeeds."""
        dev = self.model.device
        bs = self.kv.block_size
        decode = batch.decode
        pos = [seq.num_computed for seq in decode]
        ids = [seq.tokens[t] for seq, t in zip(decode, pos)]
        logits_rows = list(range(len(decode)))
        row_of_seq = {id(seq): i for i, seq in enumerate(decode)}
        # shareable: a sample's own blocks are its alone (its prompt's are shared); beams share their parents' too
        decode_rows = [DecodeRow(seq.block_table, t, _shareable(seq, bs), seq) for seq, t in zip(decode, pos)]
        for seq in batch.extend:
            t0, t1 = seq.num_computed, len(seq.tokens)
            first = len(ids)
            ids.extend(seq.tokens[t0:t1])
            pos.extend(range(t0, t1))
            shareable = _shareable(seq, bs)
            # only the last row keeps the sequence's key (the planner caches one tail per key)
            decode_rows.extend(DecodeRow(seq.block_table, t, shareable, seq if t == t1 - 1 else None) for t in range(t0, t1))
            if batch.extend_logits_last_only:
                logits_rows.append(first + t1 - t0 - 1)
            else:
                logits_rows.extend(range(first, first + t1 - t0))
            row_of_seq[id(seq)] = len(logits_rows) - 1
        for seq, s0, s1 in batch.chunks:
            ids.extend(seq.tokens[s0:s1])
            pos.extend(range(s0, s1))
            if s1 == len(seq.tokens):
                row_of_seq[id(seq)] = len(logits_rows)
                logits_rows.append(len(ids) - 1)
        plan = self.planner.plan(decode_rows, [(seq.block_table, s0, s1) for seq, s0, s1 in batch.chunks])
        logits = self.model.forward(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            PagedAttention(self.kv, plan),
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=dev),
        )
        for seq, s0, s1 in batch.chunks:
            seq.num_computed = s1
        for seq in batch.decode:
            seq.num_computed += 1
        for seq in batch.extend:
            seq.num_computed = len(seq.tokens)
        return StepOutput(logits, row_of_seq, plan.num_shared_reads, len(ids))

    def forget(self, seq) -> None:
        self.planner.forget(seq)


def _shareable(seq, block_size: int) -> int | None:
    """Leading blocks of a sequence that other rows may list: its prompt's full blocks, or all of a
    beam's (beams fork by sharing their parent's blocks)."""
    return None if seq.request.beam is not None else len(seq.request.prompt_ids) // block_size
