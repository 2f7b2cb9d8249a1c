"""`python -m bench.mla_e2e`: a DeepSeek-V2 model end to end, forklm against transformers, on the
same random-weight checkpoint written by transformers: n samples of one m_c-token prompt.

The checkpoint has DeepSeek-V2-Lite's attention (16 heads; kv_lora_rank 512, rope 64, nope 128,
v 128, no q LoRA) and hidden size (2,048), with fewer layers, experts and tokens so that float32
fits this machine twice (4 layers, the first dense; 8 routed experts of 1,408 top-2 and 2 shared;
32,000 tokens). forklm: `LLM(folder).sample(prompt, n)` (the latent pool, absorbed decode, the
shared prompt's latents read once for all samples and heads). transformers: `generate(
num_return_sequences=n, do_sample=True)` (it expands the prompt to n rows and caches per-head K/V
for each). Both float32, 2 threads, `max_tokens` new tokens each (EOS ignored); reported: wall
time, generated tokens/s (n · max_tokens / wall) and the ratio. The CPU is recorded.

    .venv/bin/python -m bench.mla_e2e --out bench/results/mla_e2e_cpu_avx2_2026-11-27.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.machine import machine_info

CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
              num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, first_k_dense_replace=1,
              kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
              n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, topk_method="greedy",
              max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
FOLDER = Path(__file__).resolve().parents[1] / ".cache" / "random-hf" / "deepseek-v2-lite-attention"


def checkpoint() -> Path:
    from transformers import AutoModelForCausalLM, DeepseekV2Config

    from bench.checkpoints import write_word_tokenizer

    if (FOLDER / "config.json").exists():
        return FOLDER
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(DeepseekV2Config(**CONFIG), dtype=torch.float32)
    hf.save_pretrained(FOLDER)
    write_word_tokenizer(FOLDER, CONFIG["vocab_size"])
    return FOLDER


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    row = run(checkpoint(), a.context, a.n, a.max_tokens)
    doc = dict(machine=machine_info(), model=dict(config=CONFIG, weights="random (transformers)"),
               context=a.context, n=a.n, max_tokens=a.max_tokens, result=row)
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.out}")


def run(folder: Path, context: int, n: int, max_tokens: int) -> dict:
    """forklm, then transformers, on the checkpoint in `folder`: the result row."""
    from forklm import LLM
    from transformers import AutoModelForCausalLM

    llm = LLM(str(folder), dtype="float32")
    ids = torch.randint(3, llm.config.vocab_size, (context,), generator=torch.Generator().manual_seed(1)).tolist()
    llm.sample(ids[:64], n=2, max_tokens=2, ignore_eos=True)  # warm: kernels, buffers
    llm.clear_prefix_cache()
    t0 = time.perf_counter()
    out = llm.sample(ids, n=n, max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    ours = time.perf_counter() - t0
    assert all(len(s.token_ids) == max_tokens for s in out.samples)
    row = dict(forklm_s=ours, forklm_prefill_s=out.stats.prefill_s, forklm_median_step_s=out.stats.median_step_s)
    print(json.dumps(row), flush=True)
    del llm
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        g = hf.generate(torch.tensor([ids]), do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                        num_return_sequences=n, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                        pad_token_id=2)
    theirs = time.perf_counter() - t0
    assert g.shape == (n, context + max_tokens)
    tokens = n * max_tokens
    row.update(transformers_s=theirs, forklm_tok_s=tokens / ours, transformers_tok_s=tokens / theirs,
               ratio=theirs / ours)
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
