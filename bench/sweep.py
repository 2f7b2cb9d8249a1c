"""`python -m bench sweep`: context length x n, forklm's attention paths against Hugging Face transformers.

For every context length m_c (outer loop) and sample count n (inner loop) each implementation
draws n samples of exactly `new_tokens` tokens from the same m_c-token prompt, same model, same
dtype, same sampling (temperature 0.8, top-p 0.95). Per point it records (units in the names):
prefill_s, decode_s, e2e_s, step_ms_median, tokens_per_s, peak_mem_mib, and the per-step floor of
docs/design.md (floor_ms, floor_naive_ms; see `bench/floor.py`) with floor_fraction =
floor / measured step. Writes JSON and a PNG (Figure 6 of the bifurcated-attention paper) and
prints a markdown table.

transformers is timed per step too (see TransformersRunner): one `generate` call per point, whose
prefill runs over n copies of the prompt and whose KV cache holds n copies.

With --llama-cpp (a .gguf model only), llama.cpp's llama-batched-bench runs at the same points after
forklm's at each m_c, flash attention off and on (rows "llama.cpp", "llama.cpp-fa"; see
`bench/llama_cpp.py`). With --presets Q4_0,Q4_K_M,... the sweep runs once per llama.cpp
quantization preset of the given .gguf file (made by llama-quantize, see `bench/presets.py`;
rows tagged "preset" and "file"), and per file both engines' peak RSS and load time are recorded
("files" in the JSON) and summarized in markdown (printed, and written next to the JSON as .md).

tokens_per_s counts decode steps, as llama.cpp does: n * decode steps / decode_s. forklm's first
token of each sample comes out of the prefill, so new_tokens tokens take new_tokens - 1 decode steps
(transformers' too: its decode_s runs from the first token to the last); tokens_per_s_generated
keeps generated tokens / decode_s (forklm's Stats.tokens_per_s), which counts one token more per
sample than the steps timed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from bench.machine import cpu_model, machine_info
from bench.floor import Ceilings, measure_ceilings, step_floor, step_matmul_shapes
from bench.memory import PeakMemory
from bench.presets import parse_presets
from bench.prompts import SEED, TEMPERATURE, TOP_P, synthetic_prompt

FORKLM_PATHS = ("standard", "bifurcated", "auto", "single-request")
# "single-request": the reference stack `LLM.sample` ran before it moved onto the engine
# (forklm/reference/), timed side by side as the baseline the engine must match.
HF_IMPL = "transformers"

ProgressFn = Callable[[str], None]


# ---------------------------------------------------------------------- inputs
def parse_int_list(text: str, name: str) -> list[int]:
    """"256,1024" -> [256, 1024]; every value must be a positive integer."""
    try:
        values = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{name} must list positive integers, got {text!r}")
    return values


def parse_paths(text: str) -> list[str]:
    """forklm attention paths to time, in the order given."""
    paths = [p.strip() for p in str(text).split(",") if p.strip()]
    bad = [p for p in paths if p not in FORKLM_PATHS]
    if bad:
        raise ValueError(f"--paths: unknown path(s) {bad}; choose from {', '.join(FORKLM_PATHS)}")
    return list(dict.fromkeys(paths))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def command_line(args: argparse.Namespace) -> str:
    """The invocation rebuilt from the parsed options (defaults included)."""
    parts = ["python", "-m", "bench", "sweep"]
    for key, value in vars(args).items():
        if key == "command" or value is None or value is False:
            continue
        parts.append("--" + key.replace("_", "-"))
        if value is not True:
            parts.append(str(value))
    return " ".join(parts)


# ---------------------------------------------------------------------- timing one point
@dataclass
class Measured:
    """What one implementation measured at one (m_c, n); times in seconds."""

    prefill_s: float
    decode_s: float
    e2e_s: float
    step_s: float  # median decode step (one forward + one sampling)
    tokens_per_s: float  # n * decode steps / decode_s (tokens the timed steps made); see decode_tokens_per_s
    peak_mem_mib: float
    extra: dict


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(e, RuntimeError) and "memory" in str(e).lower()
    )


TIMING_NOTE = ("tokens_per_s = n * decode steps / decode_s for every implementation, as llama.cpp counts: "
               "forklm and transformers take new_tokens - 1 decode steps (the first token comes out of the prefill, "
               "decode_s runs from the first token to the last), llama.cpp new_tokens (its prefill's logits make no "
               "token); tokens_per_s_generated = generated tokens / decode_s (forklm's Stats.tokens_per_s: "
               "new_tokens / (new_tokens - 1) times higher, +1.6% at 64 new tokens)")


def decode_tokens_per_s(n: int, steps: int, decode_s: float) -> float | None:
    """Tokens the timed decode steps produced per second: n samples x `steps` steps / decode_s."""
    return n * steps / decode_s if decode_s > 0 and steps > 0 else None


class ForkLMRunner:
    """Times `LLM.sample` (the engine) on one attention path, or the single-request reference.
    The engine's prefix cache is cleared before each run, so every run prefills its prompt."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def warm_up(self, prompt: list[int], paths: list[str]) -> None:
        """One short call per path, so first-call costs stay out of the timings."""
        for path in paths:
            self._sample(path, prompt[:16], n=2, max_tokens=2)

    def _sample(self, path: str, prompt: list[int], n: int, max_tokens: int) -> Any:
        kw = dict(max_tokens=max_tokens, temperature=TEMPERATURE, top_p=TOP_P, seed=SEED, ignore_eos=True)
        if path == "single-request":
            from forklm.reference.single_request import sample_single_request

            return sample_single_request(self.llm, prompt, n, **kw)
        self.llm.clear_prefix_cache()
        return self.llm.sample(prompt, n=n, attention=path, **kw)

    def run(self, path: str, prompt: list[int], n: int, new_tokens: int) -> Measured:
        with PeakMemory(self.llm.device) as mem:
            out = self._sample(path, prompt, n, new_tokens)
        st = out.stats
        if st.generated_tokens != n * new_tokens:
            raise RuntimeError(f"forklm generated {st.generated_tokens} tokens, expected {n * new_tokens}")
        return Measured(
            prefill_s=st.prefill_s,
            decode_s=st.decode_s,
            e2e_s=st.queue_s + st.prefill_s + st.decode_s,
            step_s=st.median_step_s,
            tokens_per_s=decode_tokens_per_s(n, st.steps, st.decode_s),
            peak_mem_mib=mem.peak_mib,
            extra={"steps": st.steps, "auto_paths": dict(st.path_steps),
                   "tokens_per_s_generated": st.tokens_per_s},
        )


def _step_clock(device: torch.device) -> Any:
    """A transformers StoppingCriteria that never stops and records perf_counter() after every token."""
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


class TransformersRunner:
    """Times `generate(num_return_sequences=n, do_sample=True)` of the same checkpoint.

    transformers has no per-step timer; a no-op stopping criterion, called once after each new
    token is sampled and appended, timestamps the steps. With t0 = the call's start and c_1..c_T
    those stamps: prefill_s = c_1 - t0 (the forward over n prompt copies + the first sampling),
    a step = c_(i+1) - c_i (one forward + one sampling, as forklm's step), decode_s = c_T - c_1.
    """

    def __init__(self, model: Any, device: torch.device, eos_token_id: int | None) -> None:
        self.model = model
        self.device = device
        self.eos_token_id = eos_token_id

    @classmethod
    def load(cls, source: Path, dtype: torch.dtype, device: torch.device) -> "TransformersRunner":
        """The checkpoint forklm loaded (`llm.source`: a HF folder or a .gguf file) in `dtype`; for a
        random-weight model ("random:<shape>"), transformers' own random init of the same config,
        built on the device (the values differ from forklm's; the work does not)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        from forklm.models.random_weights import PREFIX, NAMED_SHAPES

        text = str(source)
        if text.startswith(PREFIX):
            shape = text[len(PREFIX) :]
            spec = dict(NAMED_SHAPES[shape]) if shape in NAMED_SHAPES else json.loads(
                (Path(shape) / "config.json" if Path(shape).is_dir() else Path(shape)).read_text())
            arch = (spec.get("architectures") or ["LlamaForCausalLM"])[0]
            model_type = "qwen2" if arch.startswith("Qwen2") else "llama"
            config = AutoConfig.for_model(model_type, **{k: v for k, v in spec.items() if k != "architectures"})
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            model = model.eval()
            eos = spec.get("eos_token_id")
            return cls(model, device, eos[0] if isinstance(eos, list) else eos)
        source = Path(source)
        if source.is_file():  # GGUF: transformers dequantizes it to `dtype`
            model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype)
        model = model.to(device).eval()
        eos = model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        return cls(model, device, eos)

    def _generate(self, prompt: torch.Tensor, n: int, new_tokens: int, clock: Any = None) -> torch.Tensor:
        from transformers import StoppingCriteriaList

        torch.manual_seed(SEED)
        with torch.inference_mode():
            out = self.model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=TEMPERATURE,
                top_p=TOP_P,
                top_k=0,  # off, as in forklm (transformers' default is 50)
                num_return_sequences=n,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # EOS suppressed: exactly new_tokens per sample
                eos_token_id=self.eos_token_id,
                pad_token_id=self.eos_token_id if self.eos_token_id is not None else 0,
                stopping_criteria=StoppingCriteriaList([clock] if clock is not None else []),
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def warm_up(self, prompt: list[int]) -> None:
        self._generate(torch.tensor([prompt[:16]], device=self.device), 2, 2)

    def run(self, prompt: list[int], n: int, new_tokens: int) -> Measured:
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        clock = _step_clock(self.device)
        with PeakMemory(self.device) as mem:
            t0 = time.perf_counter()
            out = self._generate(ids, n, new_tokens, clock)
            e2e = time.perf_counter() - t0
        if tuple(out.shape) != (n, len(prompt) + new_tokens) or len(clock.times) != new_tokens:
            raise RuntimeError(f"transformers returned shape {tuple(out.shape)} after {len(clock.times)} steps, "
                               f"expected {(n, len(prompt) + new_tokens)} after {new_tokens}")
        stamps = clock.times
        steps = [b - a for a, b in zip(stamps, stamps[1:])]
        decode_s = stamps[-1] - stamps[0]
        return Measured(
            prefill_s=stamps[0] - t0,
            decode_s=decode_s,
            e2e_s=e2e,
            step_s=statistics.median(steps),
            tokens_per_s=decode_tokens_per_s(n, len(steps), decode_s),
            peak_mem_mib=mem.peak_mib,
            extra={"steps": len(steps), "tokens_per_s_generated": n * new_tokens / decode_s},
        )


# ---------------------------------------------------------------------- the sweep
@dataclass
class SweepConfig:
    contexts: list[int]
    ns: list[int]
    new_tokens: int
    paths: list[str]
    transformers: bool
    transformers_max_n: int
    transformers_max_tokens: int
    repeats: int = 1  # every implementation runs this many times per point, interleaved; the fastest counts
    llama_cpp: bool = False  # llama.cpp's llama-batched-bench at the same points (GGUF models only)
    presets: list[str] = field(default_factory=list)  # llama-quantize presets of the model file; [] = the file as given


def _point(m_c: int, n: int, impl: str, measured: Measured | None, floor: Any, skipped: str | None) -> dict:
    """One JSON row; timings None when skipped."""
    row: dict[str, Any] = {"m_c": m_c, "n": n, "impl": impl}
    if measured is None:
        row.update(prefill_s=None, decode_s=None, e2e_s=None, step_ms_median=None, tokens_per_s=None,
                   peak_mem_mib=None, floor_ms=floor.floor_s * 1e3 if floor else None,
                   floor_naive_ms=floor.floor_naive_s * 1e3 if floor else None, floor_fraction=None,
                   auto_paths=None, skipped=skipped)
        return row
    row.update(
        prefill_s=measured.prefill_s,
        decode_s=measured.decode_s,
        e2e_s=measured.e2e_s,
        step_ms_median=measured.step_s * 1e3,
        tokens_per_s=measured.tokens_per_s,
        peak_mem_mib=measured.peak_mem_mib,
        floor_ms=floor.floor_s * 1e3,
        floor_naive_ms=floor.floor_naive_s * 1e3,
        floor_fraction=floor.floor_s / measured.step_s if measured.step_s > 0 else None,
        auto_paths=measured.extra.get("auto_paths"),
    )
    row.update({k: v for k, v in measured.extra.items() if k != "auto_paths"})
    return row


def _transformers_skip_reason(cfg: SweepConfig, m_c: int, n: int, hf: TransformersRunner | None,
                              hf_error: str | None) -> str | None:
    if hf is None:
        return f"transformers unavailable: {hf_error}"
    if n > cfg.transformers_max_n:
        return f"n={n} > --transformers-max-n {cfg.transformers_max_n}"
    if n * m_c > cfg.transformers_max_tokens:
        return f"n*m_c={n * m_c} > --transformers-max-tokens {cfg.transformers_max_tokens}"
    return None


def run_sweep(llm: Any, cfg: SweepConfig, ceilings: Ceilings, hf: TransformersRunner | None,
              hf_error: str | None, progress: Any, llama_cpp: Any = None) -> list[dict]:
    """All points, m_c outer, n inner, implementations innermost. Failing points are recorded as skipped.

    With cfg.repeats > 1 every implementation (transformers included) runs round-robin (standard,
    bifurcated, auto, single-request, transformers, standard, ...), so a slow spell of a shared
    machine hits every one alike, and each reports its fastest run (its other runs' median steps
    are kept as step_ms_repeats). `llama_cpp` (a LlamaCppPeer) runs every n of an m_c after forklm's.
    """
    forklm = ForkLMRunner(llm)
    e = torch.finfo(llm.dtype).bits // 8
    impls = [f"forklm-{p}" for p in cfg.paths] + ([HF_IMPL] if cfg.transformers else [])
    limit = llm.config.max_position_embeddings
    points = []
    for m_c in cfg.contexts:
        prompt = synthetic_prompt(llm.tokenizer, llm.config.vocab_size, m_c)
        for n in cfg.ns:
            # weights as a step of n rows reads them (quantized: packed up to the kernel's rows)
            floor = step_floor(llm.config, llm.model.step_weight_bytes(n), e, n, m_c, cfg.new_tokens, ceilings)
            runs: dict[str, list[Measured]] = {impl: [] for impl in impls}
            skips: dict[str, str | None] = {impl: None for impl in impls}
            if m_c + cfg.new_tokens > limit:
                skips = {impl: f"m_c + new_tokens = {m_c + cfg.new_tokens} > the model's context length {limit}"
                         for impl in impls}
            elif HF_IMPL in skips:
                skips[HF_IMPL] = _transformers_skip_reason(cfg, m_c, n, hf, hf_error)
            order = [i for _ in range(cfg.repeats) for i in impls]  # transformers repeats as often as forklm
            for impl in order:
                progress.set_description(f"m_c={m_c} n={n} {impl}")
                if skips[impl] is None:
                    try:
                        if impl == HF_IMPL:
                            runs[impl].append(hf.run(prompt, n, cfg.new_tokens))
                        else:
                            runs[impl].append(forklm.run(impl.removeprefix("forklm-"), prompt, n, cfg.new_tokens))
                        progress.set_postfix_str(f"{runs[impl][-1].step_s * 1e3:.2f} ms/step")
                    except (MemoryError, ValueError, RuntimeError) as err:
                        if isinstance(err, RuntimeError) and not _is_oom(err):
                            raise
                        skips[impl] = f"{type(err).__name__}: {err}"
                    finally:
                        gc.collect()
                        if llm.device.type == "cuda":
                            torch.cuda.empty_cache()
                progress.update(1)
            for impl in impls:
                measured = None
                if skips[impl] is None and runs[impl]:
                    measured = min(runs[impl], key=lambda m: m.step_s)
                    if len(runs[impl]) > 1:
                        measured.extra["step_ms_repeats"] = [m.step_s * 1e3 for m in runs[impl]]
                points.append(_point(m_c, n, impl, measured, floor, skips[impl]))
        if llama_cpp is not None:
            points.extend(llama_cpp.run_context(m_c, cfg.ns, cfg.new_tokens, cfg.repeats, progress))
    return points


# ---------------------------------------------------------------------- output
# environment variables that pick instruction sets (recorded beside a run's numbers)
ISA_ENVIRONMENT = ("FORKLM_CPU_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                   "FORKLM_BLOCK_KERNEL_VNNI", "FORKLM_BLOCK_KERNEL_AMX", "FORKLM_LLAMA_CPP_BIN")
def build_meta(args: argparse.Namespace, llm: Any, cfg: SweepConfig, ceilings: Ceilings,
               hf_version: str | None, hf_error: str | None, llama_cpp: Any = None) -> dict:
    dev = llm.device
    meta = {
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        # the vector features forklm's rules saw (FORKLM_CPU_ISA) and the ISA PyTorch's kernels ran
        "cpu_features": machine_info(),
        "isa_environment": {k: os.environ[k] for k in ISA_ENVIRONMENT if k in os.environ},
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": hf_version,
        "transformers_error": hf_error,
        "dtype": dtype_name(llm.dtype),
        "quantize": llm.quantize,
        "device": dev.type,
        "model": str(llm.source),
        "model_parameters": llm.config.num_parameters(),
        "weight_bytes": llm.model.num_weight_bytes(),
        "new_tokens": cfg.new_tokens,
        "contexts": cfg.contexts,
        "ns": cfg.ns,
        "sampling": {"temperature": TEMPERATURE, "top_p": TOP_P, "top_k": 0, "seed": SEED},
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(args),
        "ceilings": ceilings.as_json(),
        "transformers_timing": "one generate call per point; a no-op StoppingCriteria timestamps each token: "
                               "prefill_s = to the first token, step = median gap between tokens",
        "floor_model": "max(bytes / bandwidth, FLOPs / matmul peak); bytes = weights + bifurcated KV read, "
                       "m_d = new_tokens / 2 (floor_naive_ms: naive KV read)",
        "timing": TIMING_NOTE,
        "presets": cfg.presets,
    }
    if llama_cpp is not None:
        meta["llama_cpp"] = llama_cpp.meta(dtype_name(llm.dtype))
    return meta


def _cell(row: dict | None) -> str:
    if row is None:
        return ""
    if row.get("skipped"):
        return "skipped"
    return f"{row['step_ms_median']:.2f} / {row['tokens_per_s']:.0f}"


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else ""


def markdown_table(doc: dict) -> str:
    """Rows (m_c, n); per implementation 'step ms / tok/s'; floor; two speed-ups (>1: the second is faster)."""
    points = doc["points"]
    impls = list(dict.fromkeys(p["impl"] for p in points))
    by_key = {(p["m_c"], p["n"], p["impl"]): p for p in points}
    keys = list(dict.fromkeys((p["m_c"], p["n"]) for p in points))
    llama_impls = [i for i in impls if i.startswith(("llama.cpp", "ik_llama.cpp"))]
    head = ["m_c", "n"] + [f"{i} ms / tok/s" for i in impls] + ["floor ms", "standard/bifurcated step",
                                                                 "transformers/auto e2e"]
    head += ["auto/best llama.cpp tok/s"] if llama_impls else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m_c, n in keys:
        rows = {i: by_key.get((m_c, n, i)) for i in impls}
        floor = next((r["floor_ms"] for r in rows.values() if r and r.get("floor_ms")), None)

        def get(impl: str, key: str) -> float | None:
            r = rows.get(impl)
            return r.get(key) if r and not r.get("skipped") else None

        cells = [str(m_c), str(n)] + [_cell(rows[i]) for i in impls] + [
            f"{floor:.2f}" if floor else "",
            _ratio(get("forklm-standard", "step_ms_median"), get("forklm-bifurcated", "step_ms_median")),
            _ratio(get(HF_IMPL, "e2e_s"), get("forklm-auto", "e2e_s")),
        ]
        if llama_impls:
            best = max((get(i, "tokens_per_s") or 0 for i in llama_impls), default=0)
            cells.append(_ratio(get("forklm-auto", "tokens_per_s"), best))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


class _PlainProgress:
    """Stand-in for tqdm when it is not installed: one line per point on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.desc = total, 0, ""

    def set_description(self, desc: str) -> None:
        self.desc = desc

    def set_postfix_str(self, text: str) -> None:
        print(f"[{self.done + 1}/{self.total}] {self.desc}: {text}", file=sys.stderr, flush=True)

    def update(self, k: int) -> None:
        self.done += k

    def close(self) -> None:
        pass


def _progress(total: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _PlainProgress(total)
    return tqdm(total=total, unit="pt", file=sys.stderr, dynamic_ncols=True)


def _note(msg: str) -> None:
    print(f"bench sweep: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- entry point
def build_parser(sub=None) -> argparse.ArgumentParser:
    """`python -m bench sweep`'s options (a sub-command of `sub` when given)."""
    from forklm.cli import add_model_args

    kw = {"help": "context length x n, forklm paths vs transformers (and llama.cpp)",
          "description": "Sweep context length x n; per-step latency, tokens/s, prefill, memory, floor."}
    b = sub.add_parser("sweep", **kw) if sub is not None else argparse.ArgumentParser(description=kw["description"])
    add_model_args(b)
    b.add_argument("--contexts", default="256,1024,2048,4096", help="context lengths m_c (default: 256,1024,2048,4096)")
    b.add_argument("--ns", default="1,8,32,64", help="sample counts n (default: 1,8,32,64)")
    b.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sample (default: 64)")
    b.add_argument("--paths", default="standard,bifurcated,auto,single-request",
                   help="forklm paths to time: the engine with shared segments read standard, bifurcated or auto; "
                        "single-request: the reference stack LLM.sample ran before the engine")
    b.add_argument("--repeats", type=int, default=1,
                   help="run every implementation (transformers included) this many times per point, interleaved, and report each "
                        "one's fastest run (default: 1)")
    b.add_argument("--no-transformers", action="store_true", help="skip the Hugging Face transformers baseline")
    b.add_argument("--transformers-max-n", type=int, default=64, help="largest n run through transformers")
    b.add_argument("--transformers-max-tokens", type=int, default=2048 * 64,
                   help="skip transformers where n * m_c exceeds this (it prefills and stores n prompt copies) "
                        "(default: 131072)")
    b.add_argument("--llama-cpp", action="store_true",
                   help="also run llama.cpp's llama-batched-bench at the same points (same .gguf file, same threads, "
                        "shared prompt, unified KV, flash attention off and on); build it with "
                        "scripts/build_llama_cpp.sh or set $FORKLM_LLAMA_CPP_BIN")
    b.add_argument("--presets", default=None, metavar="LIST",
                   help="comma list of llama.cpp quantization presets (e.g. Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K_M,"
                        "Q4_K_M,Q5_K_M,Q6_K): each is made once from the .gguf model with llama-quantize "
                        "--allow-requantize into .cache/presets/ and the sweep runs on every file, with both engines' "
                        "peak RSS and load time per file (default: none, the model file as given)")
    b.add_argument("--out", default=None, help="JSON path (default: bench/results/sweep_<device>_<dtype>.json)")
    b.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    return b


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    cfg = SweepConfig(
        contexts=parse_int_list(args.contexts, "contexts"),
        ns=parse_int_list(args.ns, "ns"),
        new_tokens=int(args.new_tokens),
        paths=parse_paths(args.paths),
        transformers=not args.no_transformers,
        transformers_max_n=int(args.transformers_max_n),
        transformers_max_tokens=int(getattr(args, "transformers_max_tokens", 2048 * 64)),
        repeats=int(getattr(args, "repeats", 1)),
        llama_cpp=bool(getattr(args, "llama_cpp", False)),
        presets=parse_presets(getattr(args, "presets", None)),
    )
    if cfg.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {cfg.repeats}")
    if cfg.new_tokens < 2:
        raise ValueError(f"--new-tokens must be at least 2 (a decode step needs a second token), got {cfg.new_tokens}")
    if not cfg.paths and not cfg.transformers and not cfg.llama_cpp:
        raise ValueError("nothing to time: --paths is empty and --no-transformers is set")
    return cfg


def _load_transformers(llm: Any) -> tuple[TransformersRunner | None, str | None, str | None]:
    """(runner, transformers version, error) -- runner None when transformers cannot load the model."""
    try:
        import transformers
    except ImportError as e:
        return None, None, f"not installed ({e})"
    try:
        runner = TransformersRunner.load(llm.source, llm.dtype, llm.device)
    except Exception as e:  # any loader failure becomes a recorded skip, not a crash
        return None, transformers.__version__, f"cannot load {llm.source}: {type(e).__name__}: {e}"
    return runner, transformers.__version__, None


def _ggufs_to_run(args: argparse.Namespace, cfg: SweepConfig, llama_binary: Path | None) -> list[dict]:
    """The model files of the run: the model as given, or one file per preset (made first, so a
    failing llama-quantize stops the run before anything slow)."""
    if not cfg.presets:
        return [{"preset": None, "model": args.model}]
    from bench.presets import make_preset, preset_quantizer, source_gguf

    source = source_gguf(args.model)
    quantizer = preset_quantizer(llama_binary, source, cfg.presets)
    files = []
    for preset in cfg.presets:
        made = make_preset(quantizer, source, preset, torch.get_num_threads(), note=_note)
        files.append({"preset": preset, "model": made["file"], "quantized": made})
    return files


def _memory_and_load(llm: Any, cfg: SweepConfig, llama_cpp: Any) -> dict:
    """Both engines' peak RSS and load time on llm's file (forklm: a fresh process at the sweep's largest point)."""
    from bench.presets import forklm_probe, probe_point

    m_c, n = probe_point(cfg.contexts, cfg.ns, cfg.new_tokens, llm.config.max_position_embeddings)
    path = "auto" if "auto" in cfg.paths or not cfg.paths else next(
        (p for p in cfg.paths if p != "single-request"), "auto")
    _note(f"forklm memory/load probe on {Path(str(llm.source)).name}: m_c={m_c} n={n} ({path}), fresh process")
    found = {"forklm": forklm_probe(Path(str(llm.source)), dtype_name(llm.dtype), llm.quantize or "none",
                                    torch.get_num_threads(), m_c, n, cfg.new_tokens, path)}
    if llama_cpp is not None:
        found["llama_cpp"] = llama_cpp.memory_and_load()
    return found


def run_from_args(args: argparse.Namespace) -> int:
    """`python -m bench sweep`; returns the exit code (0, or 1 when every point was skipped)."""
    from forklm import LLM

    cfg = sweep_config(args)
    llama_binary = None
    if cfg.llama_cpp or cfg.presets:
        from bench.llama_cpp import find_binary

        llama_binary = find_binary()  # before anything slow: a missing binary is a clear error
    files = _ggufs_to_run(args, cfg, llama_binary)
    measure_files = cfg.llama_cpp or bool(cfg.presets)  # memory and load time per file

    points: list[dict] = []
    file_docs: list[dict] = []
    ceilings_by_dtype: dict[Any, Ceilings] = {}
    first: dict[str, Any] = {}
    hf_version, hf_error = None, None
    for k, entry in enumerate(files):
        label = f" (preset {entry['preset']}, file {k + 1} of {len(files)})" if entry["preset"] else ""
        _note(f"loading {entry['model']}{label} (dtype {args.dtype}, device {args.device})")
        llm = LLM(entry["model"], dtype=args.dtype, device=args.device, quantize=getattr(args, "quantize", "auto"))
        dtype = dtype_name(llm.dtype)
        source = Path(str(llm.source))
        llama_cpp = None
        if cfg.llama_cpp:
            from bench.llama_cpp import LlamaCppPeer

            if source.suffix.lower() != ".gguf":
                raise ValueError(f"--llama-cpp needs a .gguf model (llama.cpp reads only GGUF files); {args.model} "
                                 f"resolves to {llm.source}")
            llama_cpp = LlamaCppPeer(llama_binary, source, torch.get_num_threads())
            _note(f"llama.cpp peer: {llama_binary}, {llama_cpp.threads} threads; forklm runs the same file in "
                  f"{dtype}, quantize={llm.quantize or 'none'}")
        hf = None
        if cfg.transformers:
            _note("loading the same checkpoint in transformers")
            hf, hf_version, hf_error = _load_transformers(llm)
            if hf_error:
                _note(f"transformers baseline off: {hf_error}")
        elif hf_version is None:
            try:
                import transformers

                hf_version = transformers.__version__
            except ImportError:
                pass

        if llm.dtype not in ceilings_by_dtype:
            _note(f"measuring bandwidth and {dtype} matmul peak")
            c = measure_ceilings(llm.dtype, llm.device, step_matmul_shapes(llm.config, max(cfg.ns), llm.device))
            _note(f"ceilings: {c.bandwidth_bytes_per_s / 1e9:.1f} GB/s copy, "
                  f"{c.matmul_flops_per_s / 1e9:.1f} GFLOP/s {dtype} matmul")
            ceilings_by_dtype[llm.dtype] = c
        ceilings = ceilings_by_dtype[llm.dtype]

        warm = synthetic_prompt(llm.tokenizer, llm.config.vocab_size, 16)
        ForkLMRunner(llm).warm_up(warm, cfg.paths)
        if hf is not None:
            hf.warm_up(warm)

        impls = (len(cfg.paths) + int(cfg.transformers)) * cfg.repeats
        llama_runs = 2 * cfg.repeats if llama_cpp else 0  # one invocation per m_c and flash-attention setting
        progress = _progress(len(cfg.contexts) * (len(cfg.ns) * impls + llama_runs))
        try:
            rows = run_sweep(llm, cfg, ceilings, hf, hf_error, progress, llama_cpp)
        finally:
            progress.close()
        for row in rows:
            row.update(preset=entry["preset"], file=str(llm.source))
        points.extend(rows)

        info: dict[str, Any] = {"preset": entry["preset"], "file": str(llm.source), "dtype": dtype,
                                "quantize": llm.quantize, "weight_bytes": llm.model.num_weight_bytes()}
        if source.suffix.lower() == ".gguf" and source.is_file():
            from bench.presets import file_info

            info.update(file_info(source))
        if entry.get("quantized"):
            info["quantized"] = entry["quantized"]
        if measure_files:
            info.update(_memory_and_load(llm, cfg, llama_cpp))
        file_docs.append(info)
        if not first:  # the run's meta: the first file's model, device and dtype
            first = {"meta": build_meta(args, llm, cfg, ceilings, hf_version, hf_error, llama_cpp),
                     "out": Path(args.out or f"bench/results/sweep_{llm.device.type}_{dtype}.json"),
                     "parameters": llm.config.num_parameters(), "device": llm.device.type}
        if k + 1 < len(files):  # the next file's model replaces this one
            del llm, hf, llama_cpp
            gc.collect()

    meta, out = first["meta"], first["out"]
    meta["transformers"] = hf_version
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    if cfg.presets:  # per file: model, dtype, weight bytes in "files"
        meta.update(model=str(files[0]["quantized"]["source"]), weight_bytes=None)
        if "llama_cpp" in meta:
            meta["llama_cpp"]["model"] = [f["file"] for f in file_docs]
    doc = {"meta": meta, "points": points, "files": file_docs}
    write_json(doc, out)
    _note(f"wrote {out}")
    per_file = [({**meta, "model": f["file"], "dtype": f["dtype"]}, [p for p in points if p["file"] == f["file"]])
                for f in file_docs]
    try:
        from bench.plot import plot_sweeps

        plot_sweeps([{"meta": m, "points": pts} for m, pts in per_file], png)
        _note(f"wrote {png}")
    except ImportError as e:
        _note(f"no plot ({e}); pip install matplotlib")
    print(f"\n{first['parameters'] / 1e6:.0f}M parameters, {meta['dtype']} on {first['device']}, "
          f"{cfg.new_tokens} new tokens; cells: median step ms / tok/s (n * decode steps / decode s)\n")
    if cfg.llama_cpp:
        print(f"llama.cpp: the same GGUF as stored (quantized), {meta['llama_cpp']['threads']} threads, shared prompt, "
              f"unified KV; its step ms is a mean (decode_s / new_tokens)\n")
    for (m, pts), f in zip(per_file, file_docs):
        if len(file_docs) > 1:
            print(f"### {f['preset'] or 'as given'}: {Path(f['file']).name}\n")
        print(markdown_table({"meta": m, "points": pts}))
        print()
    if measure_files:
        from bench.presets import preset_summary

        summary = preset_summary(points, file_docs)
        md = out.with_suffix(".md")
        md.write_text(summary)
        print(summary)
        _note(f"wrote {md}")
    if all(p.get("skipped") for p in points):
        _note("every point was skipped")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
