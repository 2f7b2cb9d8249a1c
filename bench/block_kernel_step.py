"""Where a decode step's time goes on forklm's CPU kernels, and the step with one of them turned off.

    python -m bench.block_kernel_step [--points 256x1,256x8,256x64] [--rounds 2]
        [--off block-kernel | cpu-attention | cpu-sampler | decode-stack] [--out bench/results/block_kernel_step_cpu_avx2.json]

Per point (m_c x n, random-token prompt, 33 new tokens per sample, temperature 0.8, top-p 0.95) and
round: `LLM.sample` on the default model, median step time (wall / 32 decode steps); the block
kernel's and the C++ attention's own time and calls per step (their Python entry points timed); a
torch.profiler pass giving the flash-attention kernels' time per step (PyTorch's attention path) and
the number of PyTorch operators per step; the sampler's time (`draw_rows`: draws, log-probs, the
samples' bookkeeping); then the same sample in a child process with one kernel off:
FORKLM_BLOCK_KERNEL=0 (PyTorch's int4 kernel on bfloat16 activations), FORKLM_CPU_ATTENTION=0
(PyTorch's attention path), FORKLM_CPU_SAMPLER=0 (PyTorch's sampler) or FORKLM_DECODE_STACK=0 (the
layers one call at a time from Python), rounds interleaved. With the decode stack on, the block
kernel and attention calls it makes are inside its time (the block kernel's own calls are then the
LM head's and those of steps the stack does not run). Run it alone (`flock /tmp/forklm_bench.lock ...`):
this VM's run-to-run spread is 10-20%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import child_env
from bench.machine import machine_info

NEW_TOKENS = 33
OFF_SWITCHES = {"block-kernel": "FORKLM_BLOCK_KERNEL", "cpu-attention": "FORKLM_CPU_ATTENTION",
                "cpu-sampler": "FORKLM_CPU_SAMPLER", "decode-stack": "FORKLM_DECODE_STACK"}


def _prompt(m_c: int) -> list[int]:
    return torch.randint(100, 40000, (m_c,), generator=torch.Generator().manual_seed(0)).tolist()


def _run(llm, m_c: int, n: int, seed: int) -> float:
    t = time.perf_counter()
    llm.sample(_prompt(m_c), n=n, max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
    return (time.perf_counter() - t) / (NEW_TOKENS - 1) * 1e3


def measure(points: list[tuple[int, int]], profile: bool) -> list[dict]:
    """Step ms per point in this process (the kernel on or off as the environment says)."""
    from forklm import LLM
    from forklm.attention.paged import PagedAttention
    from forklm.engine import output_processor
    from forklm.kernels import block_gemm, cpu_attention, cpu_sampler, decode_stack

    llm = LLM()
    timed = {"gemm": [0.0, 0], "paged_attention": [0.0, 0], "draw_rows": [0.0, 0], "run_layers": [0.0, 0]}

    def timer(module, name):
        fn = getattr(module, name)

        def timed_fn(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timed[name][0] += time.perf_counter() - t
                timed[name][1] += 1

        setattr(module, name, timed_fn)

    timer(block_gemm, "gemm")
    timer(cpu_attention, "paged_attention")
    timer(output_processor, "draw_rows")  # the sampler: draws, log-probs, the samples' bookkeeping
    timer(PagedAttention, "run_layers")  # the decode stack: every layer's products and attention in one call
    steps = NEW_TOKENS - 1
    out = []
    for m_c, n in points:
        _run(llm, m_c, n, seed=1)  # prompt into the prefix cache, warm
        for v in timed.values():
            v[:] = [0.0, 0]
        step = _run(llm, m_c, n, seed=2)
        row = {"m_c": m_c, "n": n, "block_kernel": block_gemm.available(), "cpu_attention": cpu_attention.available(),
               "cpu_sampler": cpu_sampler.available(), "sampler_ms_per_step": timed["draw_rows"][0] / steps * 1e3,
               "decode_stack": decode_stack.available(), "decode_stack_ms_per_step": timed["run_layers"][0] / steps * 1e3,
               "decode_stack_calls_per_step": timed["run_layers"][1] / steps,
               "step_ms": step, "kernel_ms_per_step": timed["gemm"][0] / steps * 1e3,
               "kernel_calls_per_step": timed["gemm"][1] / steps,
               "cpu_attention_ms_per_step": timed["paged_attention"][0] / steps * 1e3,
               "cpu_attention_calls_per_step": timed["paged_attention"][1] / steps}
        if profile:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                _run(llm, m_c, n, seed=3)
            events = prof.key_averages()
            row["flash_attention_ms_per_step"] = sum(
                e.self_cpu_time_total for e in events if "flash_attention" in e.key) / 1e3 / steps
            row["torch_ops_per_step"] = sum(e.count for e in events if e.key.startswith("aten::")) / steps
            row["torch_ops_self_ms_per_step"] = sum(
                e.self_cpu_time_total for e in events if e.key.startswith("aten::")) / 1e3 / steps
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="256x1,256x8,256x64", help="m_c x n, comma-separated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--off", choices=sorted(OFF_SWITCHES), default="block-kernel",
                    help="the kernel the child process runs without")
    ap.add_argument("--out", default="bench/results/block_kernel_step_cpu_avx2.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one measurement, JSON on stdout
    args = ap.parse_args(argv)
    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    if args.child:
        print(json.dumps(measure(points, profile=False)))
        return 0
    rounds = []
    for r in range(args.rounds):
        on = measure(points, profile=True)
        child = subprocess.run([sys.executable, "-m", "bench.block_kernel_step", "--child", "--points", args.points],
                               capture_output=True, text=True, check=True, env=child_env(**{OFF_SWITCHES[args.off]: "0"}))
        off = json.loads(child.stdout.strip().splitlines()[-1])
        rounds.append({"on": on, "off": off})
        for a, b in zip(on, off):
            print(f"round {r}: {a['m_c']} x {a['n']}: step {a['step_ms']:.1f} ms (decode stack {a['decode_stack_ms_per_step']:.1f} ms "
                  f"in {a['decode_stack_calls_per_step']:.0f} calls, block kernel {a['kernel_ms_per_step']:.1f} ms "
                  f"in {a['kernel_calls_per_step']:.0f} calls, C++ attention {a['cpu_attention_ms_per_step']:.1f} ms in "
                  f"{a['cpu_attention_calls_per_step']:.0f} calls, sampler {a['sampler_ms_per_step']:.1f} ms, flash attention {a['flash_attention_ms_per_step']:.1f} ms, "
                  f"{a['torch_ops_per_step']:.0f} PyTorch operators {a['torch_ops_self_ms_per_step']:.1f} ms); "
                  f"{args.off} off: {b['step_ms']:.1f} ms (sampler {b['sampler_ms_per_step']:.1f} ms)", flush=True)
    summary = []
    for i, (m_c, n) in enumerate(points):
        on = [r["on"][i] for r in rounds]
        summary.append({"m_c": m_c, "n": n,
                        "step_ms_median": statistics.median(x["step_ms"] for x in on),
                        "step_ms_off_median": statistics.median(r["off"][i]["step_ms"] for r in rounds),
                        "kernel_ms_per_step_median": statistics.median(x["kernel_ms_per_step"] for x in on),
                        "cpu_attention_ms_per_step_median": statistics.median(x["cpu_attention_ms_per_step"] for x in on),
                        "sampler_ms_per_step_median": statistics.median(x["sampler_ms_per_step"] for x in on),
                        "decode_stack_ms_per_step_median": statistics.median(x["decode_stack_ms_per_step"] for x in on),
                        "sampler_ms_per_step_off_median": statistics.median(r["off"][i]["sampler_ms_per_step"] for r in rounds),
                        "flash_attention_ms_per_step_median": statistics.median(x["flash_attention_ms_per_step"] for x in on),
                        "torch_ops_per_step_median": statistics.median(x["torch_ops_per_step"] for x in on)})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine_info(), "threads": torch.get_num_threads(), "new_tokens": NEW_TOKENS, "off": args.off,
                               "summary": summary, "rounds": rounds}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
