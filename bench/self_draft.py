"""Is a self-draft from the target's first layers worth keeping? (issue 15, drafter item 3)

    python -m bench.self_draft [--model smollm2-135m] [--m-c 1024] [--layers 4,8,12,16,20,24]
                                      [--out bench/results/self_draft_<cpu>.json]

A self-draft runs the target's first L layers, its final norm and its LM head (early exit, no
training) to propose tokens; the target verifies them exactly as for any drafter. Whether that pays
is decided by two numbers this script measures on the model as `LLM` loads it:

- **agreement** (the acceptance rate a self-draft would see): over a code context (HumanEval's
  problems and solutions, as `python -m bench spec` uses), teacher-forced, the share of positions where the
  early exit's argmax equals the full model's (greedy drafts at T = 0), and the mean of
  sum_v min(p_v, q_v) at temperature 0.8 (the acceptance probability of modified rejection sampling
  of a sampled draft, p the target's distribution, q the early exit's);
- **cost**: the time of a one-token forward (context of m_c tokens in a dense cache) through the
  first L layers and the head, relative to the full model's, and the full model's forward of k + 1
  rows (a verify) relative to one row.

From these, the expected speed-up of drafting k tokens per step with per-token acceptance a:
E[tokens per verify] = (1 - a^(k+1)) / (1 - a), time = k·cost(L) + verify(k), speed-up =
E / time (host overhead of the engine left out: it favours the self-draft). The best k in 1..6 is
reported per L.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="auto")
    p.add_argument("--m-c", type=int, default=1024, help="context tokens (default: 1024)")
    p.add_argument("--layers", default="4,8,12,16,20,24", help="early-exit depths L to measure")
    p.add_argument("--temperature", type=float, default=0.8, help="for the sampled-draft acceptance")
    p.add_argument("--problem", type=int, default=10)
    p.add_argument("--repeats", type=int, default=30, help="timed forwards per configuration (median)")
    p.add_argument("--out", default=None)
    return p


def _truncated(model, num_layers: int):
    """The same weights with only the first `num_layers` layers (a shallow copy: nothing is copied)."""
    m = copy.copy(model)
    m.layers = model.layers[:num_layers]
    return m


def _prefill_logits(model, ids, torch):
    """Logits [T, V] of a causal forward over `ids` in a fresh dense cache."""
    from forklm.reference.forked_attention import PrefillAttention
    from forklm.reference.forked_kv import ForkedKVCache

    c = model.config
    cache = ForkedKVCache(len(model.layers), c.num_kv_heads, c.head_dim, len(ids), 1, 1, model.dtype, model.device)
    x = torch.tensor(ids, device=model.device)
    return model.forward(x, torch.arange(len(ids), device=model.device), PrefillAttention(cache))


def _forward_ms(model, ids, rows: int, repeats: int, torch) -> float:
    """Median ms of a forward of `rows` new tokens after len(ids) cached ones (dense cache, causal)."""
    from forklm.reference.forked_attention import PrefillAttention
    from forklm.reference.forked_kv import ForkedKVCache

    c = model.config
    m = len(ids)
    cache = ForkedKVCache(len(model.layers), c.num_kv_heads, c.head_dim, m + rows, 1, 1, model.dtype, model.device)
    model.forward(torch.tensor(ids, device=model.device), torch.arange(m), PrefillAttention(cache))
    new = torch.tensor(ids[:rows], device=model.device)
    pos = torch.arange(m, m + rows)
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        model.forward(new, pos, PrefillAttention(cache, start=m), logits_rows=torch.arange(rows))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[3:])


def expected_speedup(a: float, k: int, cost: float, verify: float) -> float:
    """Tokens per unit of a one-row target forward: E[tokens] / (k·cost + verify)."""
    tokens = k + 1 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
    return tokens / (k * cost + verify)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    from forklm import LLM
    from bench.machine import machine_info
    from bench.spec import humaneval_context
    from bench.sweep import write_json

    llm = LLM(args.model, dtype=args.dtype, quantize=args.quantize)
    model = llm.model
    ids = humaneval_context(lambda t: llm.tokenizer.encode(t), args.m_c, args.problem)
    depths = [int(x) for x in args.layers.split(",")]
    full = _prefill_logits(model, ids, torch)  # [T, V]
    full_arg = full.argmax(-1)
    p = torch.softmax(full / args.temperature, -1)
    full_ms = _forward_ms(model, ids, 1, args.repeats, torch)
    verify = {k: _forward_ms(model, ids, k + 1, args.repeats, torch) / full_ms for k in range(1, 7)}
    print(f"full model, 1 row: {full_ms:.2f} ms; verify of k+1 rows / 1 row: "
          + ", ".join(f"k={k} {v:.2f}" for k, v in verify.items()), flush=True)
    rows = []
    for L in depths:
        m = _truncated(model, L)
        early = _prefill_logits(m, ids, torch)
        greedy = (early.argmax(-1) == full_arg).float().mean().item()
        q = torch.softmax(early / args.temperature, -1)
        sampled = torch.minimum(p, q).sum(-1).mean().item()
        cost = _forward_ms(m, ids, 1, args.repeats, torch) / full_ms
        best = {}
        for name, a in (("greedy", greedy), ("sampled", sampled)):
            s, k = max((expected_speedup(a, k, cost, verify[k]), k) for k in range(1, 7))
            best[name] = {"speedup": round(s, 3), "k": k}
        row = {"layers": L, "greedy_agreement": round(greedy, 4), "sampled_acceptance": round(sampled, 4),
               "cost_vs_full": round(cost, 3), "best": best}
        rows.append(row)
        print(f"L={L:2d}/{len(model.layers)}: greedy agreement {greedy:.3f}, sampled acceptance {sampled:.3f}, "
              f"cost {cost:.2f} of a step; best expected speed-up greedy {best['greedy']['speedup']:.2f}x "
              f"(k={best['greedy']['k']}), sampled {best['sampled']['speedup']:.2f}x (k={best['sampled']['k']})",
              flush=True)
    doc = {
        "bench": "self-draft",
        "model": str(llm.source),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "quantize": model.quantize,
        "machine": machine_info(),
        "m_c": args.m_c,
        "temperature": args.temperature,
        "full_ms": round(full_ms, 3),
        "verify_vs_one_row": {str(k): round(v, 3) for k, v in verify.items()},
        "depths": rows,
    }
    out = Path(args.out or f"bench/results/self_draft_{llm.device.type}.json")
    write_json(doc, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
