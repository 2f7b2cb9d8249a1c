"""Host-side cost of one engine decode step: everything but the model's forward and the draw.

    python -m bench.step_overhead [--out bench/results/step_overhead_cpu.json]

Scenarios (issue 13's targets: at most 2 ms each): 256 rows of distinct 2k-token prompts (n = 1
each, the chat server's case) and 64 samples of one shared 2k-token prompt. The engine is real
(scheduler, KV manager, planner, output processor, events); the model's forward is replaced by a
stub that returns logits without computing them, and the draw is timed apart and subtracted, so
what remains is the Python and tensor bookkeeping a step costs on the host. The KV pool is
allocated but never written (untouched pages cost no memory).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import forklm.engine.output_processor as output_processor
from bench.machine import machine_info
from bench.sweep import write_json
from forklm.backend import Backend
from forklm.config import ModelConfig
from forklm.engine.engine import Engine, EngineConfig
from forklm.models.llama import LlamaModel
from forklm.models.random_weights import random_weights
from forklm.sampling.params import SamplingParams


def _stub_model(vocab: int) -> LlamaModel:
    # SmolLM2-135M's heads (9 query over 3 KV, head size 64); one layer: the stub never runs it
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": vocab,
        "max_position_embeddings": 8192,
    }, source="step-overhead stub")
    cpu = torch.device("cpu")
    model = LlamaModel(cfg, random_weights(cfg, torch.float32, cpu), Backend.exact(torch.float32, cpu))

    logits = torch.zeros(1, vocab)

    def forward(input_ids, positions, attention, logits_rows=None):  # no model work: one row, expanded
        rows = len(logits_rows) if logits_rows is not None else len(input_ids)
        return logits.expand(rows, vocab)

    model.forward = forward
    return model


def measure(rows: int, prompt_len: int, shared: bool, steps: int = 30, block_size: int = 16) -> dict:
    vocab = 49152
    model = _stub_model(vocab)
    tokens = rows * (prompt_len + steps + 64) if not shared else prompt_len + rows * (steps + 64)
    cfg = EngineConfig(block_size=block_size, num_blocks=tokens // block_size + 64, max_batch_tokens=1 << 20,
                       max_num_seqs=max(rows, 1), lane_ahead_tokens=256)
    eng = Engine(model, lambda ids: "", (), cfg, has_tokenizer=False)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(n=rows if shared else 1, max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for i in range(1 if shared else rows):
        prompt = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
        eng.add_request(prompt, params, on_event=lambda e: None)
    while sum(len(r.running) for r in eng.active) < rows:  # prefill (stubbed) and start every sample
        eng.step()
    draw_s = []
    real_draw = output_processor.draw_rows

    def timed_draw(*a, **k):
        t0 = time.perf_counter()
        try:
            return real_draw(*a, **k)
        finally:
            draw_s.append(time.perf_counter() - t0)

    output_processor.draw_rows = timed_draw
    host_ms = []
    try:
        for _ in range(steps):
            draw_s.clear()
            t0 = time.perf_counter()
            eng.step()
            host_ms.append((time.perf_counter() - t0 - sum(draw_s)) * 1e3)
    finally:
        output_processor.draw_rows = real_draw
    for rid in list(eng.requests):
        eng.abort(rid)
    return {
        "rows": rows, "prompt_len": prompt_len, "shared_prompt": shared, "block_size": block_size,
        "host_ms_median": statistics.median(host_ms), "host_ms_max": max(host_ms), "steps": steps,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    results = [measure(256, 2048, shared=False), measure(64, 2048, shared=True), measure(16, 512, shared=False)]
    doc = {**machine_info(), "results": results}
    for r in results:
        kind = "one shared prompt" if r["shared_prompt"] else "distinct prompts"
        print(f"{r['rows']:4d} rows x {r['prompt_len']} tokens, {kind}: host {r['host_ms_median']:.2f} ms/step "
              f"(max {r['host_ms_max']:.2f})")
    if args.out:
        write_json(doc, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
