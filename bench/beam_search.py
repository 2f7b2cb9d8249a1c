"""`python -m bench.beam_search`: beam search on a random-weight GPT-2-medium shape (24 layers, 16
heads of 64, hidden 1024, learned positions; written by transformers, loaded from its folder).

1. Paths (forklm's engine, `LLM.beam_search`): beam width k in --widths at each m_c in --contexts,
   `max_tokens` steps (early_stopping="never": every run takes the same steps), on
   - "standard": K/V cache, the prompt's blocks shared by reference but read once per beam;
   - "bifurcated": K/V cache, the prompt and the beams' common blocks read once for all beams;
   - "el": EL-attention, the pool holds one hidden state per token and layer (half of GPT-2's K/V),
     queries expanded through W_K, the shared prompt read once;
   median decode step (s) and the bytes per cached token.
2. The largest k a fixed KV budget (--budget-gib) holds at each m_c with max_tokens per beam:
   forklm's pool (prompt once plus k tails, K/V or EL) against a cache that copies the prompt for
   every beam (transformers' `generate(num_beams=k)` expands the prompt k times).
3. End to end against transformers' `generate(num_beams=k, do_sample=False)` on the same folder at
   m_c --hf-context (float32 both; forklm's prefix cache cleared first): wall time and generated
   tokens/s (k · steps / wall), ratio.

The CPU is recorded beside the numbers. Run nothing else meanwhile (flock /tmp/forklm_bench.lock).

    .venv/bin/python -m bench.beam_search --out bench/results/beam_search_gpt2-medium_cpu_avx2_2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.machine import machine_info

SHAPE = dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257)
FOLDER = Path(__file__).resolve().parents[1] / ".cache" / "random-hf" / "gpt2-medium-4k"


def checkpoint(positions: int) -> Path:
    """The random GPT-2-medium folder (made once; a WordLevel tokenizer over its vocabulary)."""
    import transformers

    from bench.checkpoints import write_word_tokenizer

    if (FOLDER / "config.json").exists() and json.loads((FOLDER / "config.json").read_text())["n_positions"] >= positions:
        return FOLDER
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_positions=positions, bos_token_id=1, eos_token_id=2, **SHAPE)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(FOLDER)
    write_word_tokenizer(FOLDER, SHAPE["vocab_size"])
    return FOLDER


def prompt(m_c: int, vocab: int = SHAPE["vocab_size"]) -> list[int]:
    return torch.randint(3, vocab, (m_c,), generator=torch.Generator().manual_seed(m_c)).tolist()


def run_paths(llm, contexts, widths, steps) -> list[dict]:
    rows = []
    for m_c in contexts:
        ids = prompt(m_c, llm.config.vocab_size)
        for path in ("standard", "bifurcated", "el"):
            for k in widths:
                t0 = time.perf_counter()
                out = llm.beam_search(ids, k, max_tokens=steps, early_stopping="never", ignore_eos=True,
                                      attention=path)
                wall = time.perf_counter() - t0
                st = out.stats
                row = dict(m_c=m_c, k=k, path=path, steps=st.steps, median_step_s=statistics.median(st.step_s),
                           prefill_s=st.prefill_s, cached_prompt_tokens=st.cached_prompt_tokens, wall_s=wall)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def largest_widths(llm, contexts, steps, budget: int) -> list[dict]:
    c = llm.config
    kv = c.kv_bytes_per_token(4)
    el = c.el_cache_config().kv_bytes_per_token(4)
    out = []
    for m_c in contexts:
        row = dict(m_c=m_c, budget_bytes=budget, kv_bytes_per_token=kv, el_bytes_per_token=el,
                   forklm_kv=(budget - m_c * kv) // (steps * kv), forklm_el=(budget - m_c * el) // (steps * el),
                   prompt_per_beam=budget // ((m_c + steps) * kv))
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def against_transformers(llm, folder: Path, m_c: int, widths, steps) -> list[dict]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt(m_c, llm.config.vocab_size)
    rows = []
    for k in widths:
        llm.clear_prefix_cache()
        t0 = time.perf_counter()
        out = llm.beam_search(ids, k, max_tokens=steps, early_stopping="never", ignore_eos=True)
        ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        with torch.no_grad():
            g = hf.generate(torch.tensor([ids]), num_beams=k, num_return_sequences=k, max_new_tokens=steps,
                            do_sample=False, early_stopping="never", pad_token_id=2, eos_token_id=None)
        theirs = time.perf_counter() - t0
        same = [s.token_ids for s in out.samples] == [g[i, m_c:].tolist() for i in range(k)]
        row = dict(m_c=m_c, k=k, steps=steps, forklm_s=ours, transformers_s=theirs,
                   forklm_tok_s=k * steps / ours, transformers_tok_s=k * steps / theirs, ratio=theirs / ours,
                   same_hypotheses=same)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--widths", default="4,8,16")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--budget-gib", type=float, default=2.0)
    ap.add_argument("--hf-context", type=int, default=1024)
    ap.add_argument("--hf-widths", default="4,8")
    ap.add_argument("--skip", default="", help="parts to skip: paths, transformers")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from forklm import LLM

    contexts = [int(x) for x in a.contexts.split(",")]
    widths = [int(x) for x in a.widths.split(",")]
    folder = checkpoint(max(4096, max(contexts)) + 256)
    llm = LLM(str(folder), dtype="float32")
    doc = dict(machine=machine_info(), model=dict(shape=SHAPE, folder=str(folder), weights="random (transformers)"),
               steps=a.steps)
    doc["largest_widths"] = largest_widths(llm, contexts, a.steps, int(a.budget_gib * 2**30))
    if "paths" not in a.skip:
        doc["paths"] = run_paths(llm, contexts, widths, a.steps)
    if "transformers" not in a.skip:
        doc["transformers"] = against_transformers(llm, folder, a.hf_context, [int(x) for x in a.hf_widths.split(",")],
                                                   a.steps)
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
