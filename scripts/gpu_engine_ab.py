"""The engine's decode attention on a GPU, end to end: the PyTorch path against the Triton kernel.

    python3 scripts/gpu_engine_ab.py --out "$OUT/engine_ab.json"      # on the device machine

Random Llama-3-8B weights in bfloat16 (`random:llama3-8b`); per (m_c, n) and per attention path
(standard, bifurcated), one engine with decode_kernel="torch" and one with "triton", the same
request (a random m_c-token prompt, n samples of 32 tokens, seed 0, EOS ignored), alternated;
median decode step and tokens/s (steps x n / decode s), and how many samples the two kernels draw
alike (bfloat16 attention in another order may tip a draw: a count, not a test). Writes JSON after
every point, so a cut-short run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from forklm import LLM  # noqa: E402
from forklm.sampling.params import SamplingOptions  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(llm: LLM, kernel: str, path: str, prompt: list[int], n: int, new_tokens: int) -> dict:
    engine = llm.engine(decode_kernel=kernel)
    params = SamplingOptions(n=n, max_tokens=new_tokens, temperature=0.8, top_p=0.95, seed=0,
                             ignore_eos=True).params(attention=path)
    warm = engine.add_request(prompt[:16], SamplingOptions(n=2, max_tokens=2, seed=0).params(attention=path))
    engine.run()
    assert warm.error is None, warm.error
    sync()
    t0 = time.perf_counter()
    state = engine.add_request(prompt, params)
    engine.run()
    sync()
    if state.error is not None:
        raise state.error
    st = state.output.stats
    return {"kernel": kernel, "path": path, "step_ms_median": st.median_step_s * 1e3, "steps": st.steps,
            "tokens_per_s": n * st.steps / st.decode_s if st.decode_s else None, "prefill_s": st.prefill_s,
            "wall_s": time.perf_counter() - t0, "tokens": [s.token_ids for s in state.output.samples]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--ns", default="16,64")
    ap.add_argument("--paths", default="bifurcated,standard")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="random:llama3-8b")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to check the script (TRITON_INTERPRET=1)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    doc = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "model": args.model, "dtype": args.dtype, "new_tokens": args.new_tokens, "points": []}
    rng = random.Random(0)
    for m_c in map(int, args.contexts.split(",")):
        prompt = [rng.randrange(100, min(100000, llm.config.vocab_size)) for _ in range(m_c)]
        for n in map(int, args.ns.split(",")):
            for path in args.paths.split(","):
                rows = {}
                for kernel in ("torch", "triton"):
                    try:
                        rows[kernel] = run(llm, kernel, path, prompt, n, args.new_tokens)
                    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                        rows[kernel] = {"kernel": kernel, "path": path, "error": f"{type(e).__name__}: {e}"}
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                a, b = rows["torch"].pop("tokens", None), rows["triton"].pop("tokens", None)
                same = sum(x == y for x, y in zip(a, b)) if a and b else None
                point = {"m_c": m_c, "n": n, "path": path, "torch": rows["torch"], "triton": rows["triton"],
                         "samples_alike": same}
                doc["points"].append(point)
                print(json.dumps(point), flush=True)
                args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
