"""The timing of speculative sampling's points, shared by `python -m bench spec` (spec.py) and its
`--pair` sweep (spec_pair.py): one request per mode on its engine, the fastest of interleaved repeats."""

from __future__ import annotations

import dataclasses
import time


def _spec_metrics(engine) -> dict:
    m = engine.metrics.speculative
    return dataclasses.asdict(m) if m is not None else {}


def run_mode(engine, prompt: list[int], n: int, new_tokens: int, temperature: float, seed: int) -> dict:
    """One request of n samples on `engine` to the end; its timing and the speculator's counters."""
    from forklm.sampling.params import SamplingParams

    before, steps0 = _spec_metrics(engine), engine.metrics.steps
    params = SamplingParams(n=n, max_tokens=new_tokens, temperature=temperature, seed=seed, ignore_eos=True)
    t0 = time.perf_counter()
    state = engine.add_request(prompt, params)
    engine.run()
    wall = time.perf_counter() - t0
    if state.error is not None:
        raise state.error
    out = state.output
    after = _spec_metrics(engine)
    d = {k: after[k] - before.get(k, 0) for k in after}
    res = {
        "wall_s": round(wall, 4),
        "prefill_s": round(out.stats.prefill_s, 4),
        "decode_s": round(out.stats.decode_s, 4),
        "ms_per_token": round(1e3 * out.stats.decode_s / max(new_tokens - 1, 1), 3),
        "tokens_per_s": round(n * (new_tokens - 1) / out.stats.decode_s, 1) if out.stats.decode_s else None,
        "steps": engine.metrics.steps - steps0,
        "tokens": [s.token_ids for s in out.samples],
    }
    if d:
        res.update(
            acceptance_rate=round(d["accepted_tokens"] / d["draft_tokens"], 4) if d["draft_tokens"] else 0.0,
            tokens_per_draft=round(d["emitted_tokens"] / d["drafts"], 3) if d["drafts"] else 0.0,
            draft_tokens=d["draft_tokens"], accepted_tokens=d["accepted_tokens"], drafts=d["drafts"],
            spec_steps=d["spec_steps"], off_steps=d["off_steps"],
            draft_s=round(d["draft_s"], 4), verify_s=round(d["verify_s"], 4),
        )
    return res


def run_point(modes: dict, prompt: list[int], n: int, new_tokens: int, temperature: float, seed: int,
              repeats: int) -> dict[str, dict]:
    """Every mode's engine ("regular" first) on one point, `repeats` times interleaved; per mode its
    fastest run, whether its samples equal regular decoding's and its speed-up over it."""
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for name, engine in modes.items():
            res = run_mode(engine, prompt, n, new_tokens, temperature, seed)
            if name not in best or res["decode_s"] < best[name]["decode_s"]:
                best[name] = res
    ref = best["regular"]
    ref_tokens = ref["tokens"]
    for name, res in best.items():
        res["identical"] = res.pop("tokens") == ref_tokens
        if name != "regular":
            res["speedup"] = round(ref["decode_s"] / res["decode_s"], 3)
    return best


def point_line(row: dict) -> str:
    """One point's modes on one line (the progress print)."""
    parts = [f"m_c {row['m_c']} n {row['n']} T {row['temperature']}:"]
    for name, r in row["modes"].items():
        s = f"{name} {r['ms_per_token']} ms/tok"
        if name != "regular":
            s += (f" x{r['speedup']} acc {r.get('acceptance_rate')} tok/draft {r.get('tokens_per_draft')}"
                  f" off {r.get('off_steps')}/{r['steps']}{'' if r['identical'] else ' DIFFERS'}")
        parts.append(s)
    return " | ".join(parts)
