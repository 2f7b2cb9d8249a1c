"""llama.cpp as a `python -m bench sweep` peer: parsing llama-batched-bench's output, the command it runs, the
missing-binary error, the presets (names, paths, llama-quantize's command), the load-time and RSS
figures, forklm's decode tokens/s, and (where scripts/build_llama_cpp.sh has built it) real tiny runs."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from bench import llama_cpp, presets
from bench.llama_cpp import (LlamaCppNotFound, LlamaCppPeer, batched_bench_command, context_size, find_binary,
                             parse_jsonl, to_point)
from bench.sweep import ForkLMRunner, decode_tokens_per_s, markdown_table
from bench.cli import main
from forklm.outputs import Stats

DATA = Path(__file__).parent / "data"
# Real output (stdout + stderr) of the binary built by scripts/build_llama_cpp.sh, SmolLM2-135M Q4_1:
# -npp 64 -ntg 8 -npl 1,4 -pps -kvu -t 2 -c 96, flash attention off / on, --output-format jsonl.
FIXTURES = {False: DATA / "llama_batched_bench_fa_off.txt", True: DATA / "llama_batched_bench_fa_on.txt"}


@pytest.mark.parametrize("flash_attn", [False, True])
def test_parses_real_output_into_forklm_rows(flash_attn):
    text = FIXTURES[flash_attn].read_text()
    raw = parse_jsonl(text)
    assert [(r["pp"], r["tg"], r["pl"]) for r in raw] == [(64, 8, 1), (64, 8, 4)]  # log lines skipped
    rows = [to_point(r, "cmd") for r in raw]
    for r, row in zip(raw, rows):
        assert row["impl"] == ("llama.cpp-fa" if flash_attn else "llama.cpp") and row["flash_attn"] is flash_attn
        assert (row["m_c"], row["n"], row["steps"]) == (64, r["pl"], 8)
        assert row["prefill_s"] == r["t_pp"] and row["decode_s"] == r["t_tg"] and row["e2e_s"] == r["t"]
        assert row["step_ms_median"] == pytest.approx(r["t_tg"] / 8 * 1e3)
        assert row["tokens_per_s"] == pytest.approx(r["speed_tg"], rel=1e-3)  # generated tokens / decode time
        assert row["threads"] == 2 and row["n_kv"] == 64 + r["pl"] * 8 and row["command"] == "cmd"
        assert not row.get("skipped")


def test_rows_fit_the_sweep_table():
    rows = [to_point(r, "cmd") for fa in (False, True) for r in parse_jsonl(FIXTURES[fa].read_text())]
    forklm = {"m_c": 64, "n": 4, "impl": "forklm-auto", "step_ms_median": 10.0, "tokens_per_s": 400.0,
              "floor_ms": 1.0, "e2e_s": 1.0}
    table = markdown_table({"points": [forklm] + rows})
    assert "llama.cpp ms / tok/s" in table and "llama.cpp-fa ms / tok/s" in table
    assert "auto/best llama.cpp tok/s" in table
    best = max(r["tokens_per_s"] for r in rows if r["n"] == 4)
    row_64_4 = next(line for line in table.splitlines() if line.startswith("| 64 | 4 |"))
    assert row_64_4.rstrip(" |").endswith(f"{400.0 / best:.2f}x")


def test_command_shares_the_prompt_in_a_unified_kv():
    args = batched_bench_command(Path("/bin/bb"), Path("/m/model.gguf"), 1024, [1, 8, 64], 64, 2, flash_attn=True)
    assert args[0] == "/bin/bb"

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert value("-m") == "/m/model.gguf"
    assert (value("-npp"), value("-ntg"), value("-npl")) == ("1024", "64", "1,8,64")
    assert "-pps" in args and "-kvu" in args and value("-fa") == "on"
    assert value("-t") == value("-tb") == "2"
    assert value("-c") == str(1024 + 64 * 64) == str(context_size(1024, [1, 8, 64], 64))
    assert value("--output-format") == "jsonl"
    assert value("-lv") == "4"  # the info lines that carry the load times
    assert value("-fa") == "on"
    off = batched_bench_command(Path("/bin/bb"), Path("/m/model.gguf"), 256, [1], 8, 2, flash_attn=False)
    assert off[off.index("-fa") + 1] == "off"


def test_missing_binary_names_the_build_script(tmp_path):
    with pytest.raises(LlamaCppNotFound, match="scripts/build_llama_cpp.sh"):
        find_binary({llama_cpp.ENV_VAR: str(tmp_path / "nope")})
    not_executable = tmp_path / "llama-batched-bench"
    not_executable.write_text("")
    with pytest.raises(LlamaCppNotFound, match="FORKLM_LLAMA_CPP_BIN"):
        find_binary({llama_cpp.ENV_VAR: str(not_executable)})


def test_bench_without_the_binary_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(llama_cpp.ENV_VAR, str(tmp_path / "missing"))
    rc = main(["sweep", "--llama-cpp", "--contexts", "16", "--ns", "1", "--out", str(tmp_path / "x.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m bench: error:") and "scripts/build_llama_cpp.sh" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_bench_llama_cpp_needs_a_gguf_model(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "llama-batched-bench"  # never run: the model check comes first
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv(llama_cpp.ENV_VAR, str(fake))
    config = tmp_path / "config.json"  # a tiny random-weight model: not a GGUF file
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
                                  "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "num_key_value_heads": 1, "max_position_embeddings": 64}))
    rc = main(["sweep", "--llama-cpp", "--model", f"random:{config}", "--dtype", "float32", "--device", "cpu",
               "--contexts", "16", "--ns", "1", "--out", str(tmp_path / "x.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--llama-cpp needs a .gguf model" in err and "Traceback" not in err


def _built_binary() -> Path:
    try:
        return find_binary()
    except LlamaCppNotFound:
        pytest.skip("llama-batched-bench not built (scripts/build_llama_cpp.sh; CI does not build it)")


def test_real_binary_runs_a_tiny_point(smollm2_gguf):
    peer = LlamaCppPeer(_built_binary(), smollm2_gguf, threads=2)
    rows = peer.run_context(32, [1, 2], 4)
    assert [(r["m_c"], r["n"], r["impl"]) for r in rows] == [
        (32, 1, "llama.cpp"), (32, 1, "llama.cpp-fa"), (32, 2, "llama.cpp"), (32, 2, "llama.cpp-fa")]
    for r in rows:
        assert not r.get("skipped"), r
        assert r["decode_s"] > 0 and r["prefill_s"] > 0 and r["tokens_per_s"] > 0 and r["steps"] == 4
        assert r["n_kv"] == 32 + r["n"] * 4 and r["threads"] == 2
        assert str(smollm2_gguf) in r["command"] and " -pps -kvu " in r["command"]
    meta = peer.meta("float32")
    assert "version" in meta["version"] and meta["forklm_dtype"] == "float32"
    json.dumps(meta)


def test_bench_puts_llama_cpp_rows_beside_forklm(tmp_path, smollm2_gguf, capsys):
    _built_binary()
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["sweep", "--llama-cpp", "--dtype", "float32", "--device", "cpu", "--contexts", "32", "--ns", "1,2",
               "--new-tokens", "3", "--paths", "auto", "--no-transformers", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert [(p["m_c"], p["n"], p["impl"]) for p in doc["points"]] == [
        (32, 1, "forklm-auto"), (32, 2, "forklm-auto"),
        (32, 1, "llama.cpp"), (32, 1, "llama.cpp-fa"), (32, 2, "llama.cpp"), (32, 2, "llama.cpp-fa")]
    assert all(not p.get("skipped") and p["tokens_per_s"] > 0 for p in doc["points"])
    meta = doc["meta"]["llama_cpp"]
    assert meta["model"] == str(smollm2_gguf) and meta["forklm_dtype"] == "float32" == doc["meta"]["dtype"]
    assert meta["threads"] == doc["meta"]["threads"]
    assert "--llama-cpp" in doc["meta"]["command"] and doc["meta"]["cpu_model"]
    assert png.stat().st_size > 10_000
    table = capsys.readouterr().out
    assert "llama.cpp-fa ms / tok/s" in table and "auto/best llama.cpp tok/s" in table
    assert all(p["preset"] is None and p["file"] == str(smollm2_gguf) for p in doc["points"])
    [f] = doc["files"]  # memory and load time of both engines on the file
    assert f["file"] == str(smollm2_gguf) and f["tensor_types"]["Q4_1"]["tensors"] > 0
    assert "error" not in f["forklm"], f["forklm"]
    assert f["forklm"]["peak_rss_mib"] >= f["forklm"]["baseline_rss_mib"] > 0 and f["forklm"]["load_s"] > 0
    assert f["forklm"]["point"] == {"m_c": 32, "n": 2, "new_tokens": 3, "attention": "auto"}
    assert f["llama_cpp"]["peak_rss_mib"] > 0 and f["llama_cpp"]["load_s"] > 0 and f["llama_cpp"]["ready_s"] > 0
    assert "load time" in doc["meta"]["llama_cpp"]["load_time"]["load_s"]
    assert (tmp_path / "b.md").read_text().startswith("### as given")


# ---------------------------------------------------------------------- presets
def test_preset_names_are_checked_and_normalized():
    assert presets.parse_presets("q4_k_m, Q8_0,Q4_K_M") == ["Q4_K_M", "Q8_0"]
    assert presets.parse_presets(None) == [] == presets.parse_presets("")
    assert presets.parse_presets(",".join(presets.COMMON_PRESETS)) == list(presets.COMMON_PRESETS)
    with pytest.raises(ValueError) as e:
        presets.parse_presets("Q4_0,Q7_K,IQ2_XXS")
    msg = str(e.value)
    assert "Q7_K" in msg and "IQ2_XXS" in msg.split(";")[0] and "valid: Q4_0, Q4_1" in msg
    assert all(name in msg for name in presets.PRESETS)


def test_preset_path_and_quantize_command():
    src = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    dest = presets.preset_path(src, "Q4_K_M", Path("/c/presets"))
    assert dest == Path("/c/presets/SmolLM2-135M-Instruct.Q4_1-Q4_K_M.gguf")
    assert presets.preset_path(src, "Q8_0").parent == presets.REPO_ROOT / ".cache" / "presets"
    args = presets.quantize_command(Path("/b/llama-quantize"), src, dest, "Q4_K_M", 2)
    assert args == ["/b/llama-quantize", "--allow-requantize", str(src), str(dest), "Q4_K_M", "2"]


def test_quantize_binary_sits_beside_batched_bench(tmp_path):
    bench = tmp_path / "llama-batched-bench"
    with pytest.raises(FileNotFoundError, match="llama-quantize.*scripts/build_llama_cpp.sh"):
        presets.quantize_binary(bench)
    q = tmp_path / "llama-quantize"
    q.write_text("#!/bin/sh\n")
    q.chmod(0o755)
    assert presets.quantize_binary(bench) == q


def test_preset_quantizer_needed_only_for_a_missing_file(tmp_path):
    bench, src, folder = tmp_path / "ik" / "llama-batched-bench", tmp_path / "m.Q4_1.gguf", tmp_path / "presets"
    bench.parent.mkdir()
    with pytest.raises(FileNotFoundError, match="llama-quantize"):  # Q8_0's file is missing: it must be made
        presets.preset_quantizer(bench, src, ["Q4_0", "Q8_0"], folder)
    folder.mkdir()
    for p in ("Q4_0", "Q8_0"):
        presets.preset_path(src, p, folder).write_bytes(b"GGUF")
    assert presets.preset_quantizer(bench, src, ["Q4_0", "Q8_0"], folder) == bench.with_name("llama-quantize")


def _fake_quantizer(tmp_path: Path, body: str) -> Path:
    """A stand-in llama-quantize: `--allow-requantize SRC DST PRESET THREADS`."""
    q = tmp_path / "bin" / "llama-quantize"
    q.parent.mkdir(exist_ok=True)
    q.write_text("#!/bin/sh\n" + body)
    q.chmod(0o755)
    return q


def test_make_preset_once_then_reuse(tmp_path):
    src = tmp_path / "m.Q4_1.gguf"
    src.write_bytes(b"GGUF-source")
    log = tmp_path / "calls"
    q = _fake_quantizer(tmp_path, f'echo "$@" >> {log}\ncp "$2" "$3"\n')
    made = presets.make_preset(q, src, "Q5_0", 3, folder=tmp_path / "presets")
    dest = tmp_path / "presets" / "m.Q4_1-Q5_0.gguf"
    assert made["made"] is True and made["file"] == str(dest) and dest.read_bytes() == b"GGUF-source"
    assert made["command"] == " ".join(presets.quantize_command(q, src, dest, "Q5_0", 3))
    assert log.read_text().split() == ["--allow-requantize", str(src), str(dest) + ".part", "Q5_0", "3"]
    again = presets.make_preset(q, src, "Q5_0", 3, folder=tmp_path / "presets")
    assert again["made"] is False and again["file"] == str(dest)
    assert len(log.read_text().splitlines()) == 1  # not run again


def test_make_preset_failure_leaves_no_file(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(b"x")
    q = _fake_quantizer(tmp_path, 'echo partial > "$3"\necho "llama_model_quantize: failed to quantize" >&2\nexit 1\n')
    with pytest.raises(RuntimeError, match="llama-quantize Q6_K exited 1: llama_model_quantize: failed"):
        presets.make_preset(q, src, "Q6_K", 2, folder=tmp_path / "p")
    assert list((tmp_path / "p").iterdir()) == []


def test_source_gguf_must_be_a_gguf_file(tmp_path):
    with pytest.raises(ValueError, match="--presets needs a .gguf model"):
        presets.source_gguf(str(tmp_path))
    f = tmp_path / "x.gguf"
    f.write_bytes(b"")
    assert presets.source_gguf(str(f)) == f


def test_bench_rejects_an_unknown_preset_before_loading(tmp_path, capsys):
    rc = main(["sweep", "--llama-cpp", "--presets", "Q4_0,Q9_9", "--out", str(tmp_path / "x.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "unknown preset(s) Q9_9" in err and "valid: Q4_0" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_bench_presets_need_a_gguf_model(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "llama-batched-bench"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    _fake_quantizer(tmp_path, "exit 1\n").rename(tmp_path / "llama-quantize")
    monkeypatch.setenv(llama_cpp.ENV_VAR, str(fake))
    rc = main(["sweep", "--presets", "Q4_0", "--model", str(tmp_path), "--out", str(tmp_path / "x.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--presets needs a .gguf model" in err and "Traceback" not in err


# ---------------------------------------------------------------------- load time, RSS
# Real stderr of the binary built by scripts/build_llama_cpp.sh (SmolLM2-135M Q4_1, -lv 4), on a busy machine.
STDERR_LV4 = DATA / "llama_batched_bench_stderr_lv4.txt"


def test_load_times_from_a_captured_log():
    text = STDERR_LV4.read_text()
    assert llama_cpp.parse_load_time_s(text) == pytest.approx(5.17419)  # llama_perf_context_print load time
    assert llama_cpp.parse_ready_s(text) == pytest.approx(0.192527)  # context built: sched_reserve's line
    assert llama_cpp.parse_load_time_s("") is None and llama_cpp.parse_ready_s("no log\n") is None
    assert llama_cpp.log_timestamp_s("1.02.003.004 I x") == pytest.approx(62.003004)
    assert llama_cpp.log_timestamp_s("\x1b[34m0.00.205.452\x1b[0m I sched_reserve: reserve took") == pytest.approx(
        0.205452)
    assert llama_cpp.log_timestamp_s("......") is None
    head, _, _ = text.partition("# stderr:")
    assert "-lv 4" in head.splitlines()[0] and len(parse_jsonl(head)) == 2


def test_invocations_summary_and_the_wall_time_fallback():
    inv = [{"m_c": 64, "returncode": 0, "peak_rss_mib": 120.0, "load_s": 0.3, "ready_s": 0.10},
           {"m_c": 2048, "returncode": 0, "peak_rss_mib": 180.0, "load_s": 0.5, "ready_s": 0.12},
           {"m_c": 4096, "returncode": 1, "peak_rss_mib": 900.0, "load_s": None, "ready_s": None},
           {"m_c": 1024, "returncode": 0, "peak_rss_mib": 150.0, "load_s": 0.4, "ready_s": 0.11}]
    s = llama_cpp.summarize_invocations(inv, tiny_run=lambda: pytest.fail("not needed"))
    assert (s["peak_rss_mib"], s["peak_rss_m_c"]) == (180.0, 2048)  # failed runs left out
    assert s["load_s"] == pytest.approx(0.4) and s["ready_s"] == pytest.approx(0.11)
    assert s["load_s_runs"] == [0.3, 0.5, 0.4] and s["load_source"] == llama_cpp.LOAD_SOURCE_PERF
    no_log = [dict(i, load_s=None, ready_s=None) for i in inv]
    tiny = llama_cpp.Finished(0, "", "", 100.0, 0.25)
    s = llama_cpp.summarize_invocations(no_log, tiny_run=lambda: tiny)
    assert s["load_s"] == 0.25 and s["load_source"] == llama_cpp.LOAD_SOURCE_WALL and s["ready_s"] is None


def _child(code: str) -> list[str]:
    return [sys.executable, "-I", "-S", "-c", code]


def test_child_rss_is_its_own_not_the_parents():
    """Linux copies the parent's peak RSS into a child's ru_maxrss across fork + exec; this test's
    process (torch imported, 300+ MiB here) must not show through a small child's figure."""
    big = torch.ones(256 * 2**20 // 4)  # the parent: +256 MiB resident
    assert big.sum() > 0
    alloc = "b = bytearray(96 * 2**20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('done')"
    done = llama_cpp.run_measured(_child(alloc))
    assert done.returncode == 0 and done.stdout == "done\n"
    assert 96 < done.maxrss_mib < 150, done.maxrss_mib
    assert llama_cpp.run_measured(_child("import sys; sys.exit(3)")).returncode == 3
    assert llama_cpp.run_measured(_child("import os; os.kill(os.getpid(), 9)")).returncode == 128 + 9
    missing = llama_cpp.run_measured(["/nonexistent/llama-batched-bench"])
    assert missing.returncode == 127 and "cannot run" in missing.stderr


def test_helper_report_parses():
    assert llama_cpp.parse_report("132772 14.08") == (pytest.approx(129.66, abs=0.01), 14.08)
    report = Path("/tmp/r")
    args = llama_cpp.measured_command(["/b/llama-batched-bench", "-m", "x"], report, python="/py")
    assert args[:3] == ["/py", "-I", "-S"] and args[-4:] == [str(report), "/b/llama-batched-bench", "-m", "x"]


# ---------------------------------------------------------------------- forklm's probe, tokens/s, summary
def test_probe_command_and_output():
    args = presets.probe_command(Path("/m.gguf"), "float32", "gguf", 2, 2048, 64, 64, "auto", python="/py")
    assert args[:4] == ["/py", "-m", "bench.presets", "probe"]
    assert args[args.index("--model") + 1] == "/m.gguf" and args[args.index("--quantize") + 1] == "gguf"
    assert [args[args.index(f) + 1] for f in ("--m-c", "--n", "--new-tokens", "--threads")] == ["2048", "64", "64", "2"]
    out = "noise\nforklm-probe: {\"load_s\": 0.5, \"peak_rss_mib\": 400}\n"
    assert presets.parse_probe_output(out) == {"load_s": 0.5, "peak_rss_mib": 400}
    with pytest.raises(ValueError):
        presets.parse_probe_output("Traceback ...")
    assert presets.probe_point([256, 1024, 4096], [1, 8, 64], 64, 2048) == (1024, 64)
    assert presets.probe_point([256, 1024], [1, 8], 64, None) == (1024, 8)


def test_decode_tokens_per_s_counts_decode_steps():
    assert decode_tokens_per_s(8, 63, 2.0) == pytest.approx(8 * 63 / 2.0)
    assert decode_tokens_per_s(8, 0, 2.0) is None and decode_tokens_per_s(8, 63, 0.0) is None


class _FakeLLM:
    """What ForkLMRunner.run touches: a sample call whose stats say 64 tokens in 63 decode steps."""

    device = torch.device("cpu")

    def clear_prefix_cache(self) -> None:
        pass

    def sample(self, prompt, n, attention, max_tokens, **kw):
        st = Stats(prompt_tokens=len(prompt), generated_tokens=n * max_tokens, prefill_s=0.5, decode_s=2.0,
                   steps=max_tokens - 1, path_steps={attention: max_tokens - 1}, step_s=[2.0 / 63] * 63)

        class Out:
            stats = st

        return Out()


def test_forklm_rows_count_decode_steps_like_llama_cpp():
    m = ForkLMRunner(_FakeLLM()).run("auto", list(range(100)), n=8, new_tokens=64)
    assert m.tokens_per_s == pytest.approx(8 * 63 / 2.0)  # n x decode steps / decode time
    assert m.extra["tokens_per_s_generated"] == pytest.approx(8 * 64 / 2.0)  # the old count, +1.6%
    assert m.extra["steps"] == 63


def _row(impl, n, tps, m_c=256, file="/p/a.gguf", **kw):
    return {"m_c": m_c, "n": n, "impl": impl, "tokens_per_s": tps, "file": file, **kw}


def test_preset_summary_compares_with_the_faster_flash_attention_setting():
    points = [_row("forklm-auto", 1, 100.0), _row("llama.cpp", 1, 50.0, flash_attn=False),
              _row("llama.cpp-fa", 1, 80.0, flash_attn=True),
              _row("forklm-auto", 8, 400.0), _row("llama.cpp", 8, 200.0, flash_attn=False),
              _row("llama.cpp-fa", 8, None, flash_attn=True, skipped="exited 1"),
              _row("forklm-auto", 1, 1.0, file="/p/b.gguf")]
    files = [{"preset": "Q4_K_M", "file": "/p/a.gguf", "file_mib": 100.5,
              "tensor_types": {"Q5_0": {"tensors": 166, "bytes": 1}, "Q4_K": {"tensors": 16, "bytes": 1}},
              "forklm": {"load_s": 0.4, "load_first_eval_s": 0.6, "baseline_rss_mib": 350.0, "peak_rss_mib": 500.0,
                         "peak_minus_baseline_mib": 150.0, "point": {"m_c": 256, "n": 8}},
              "llama_cpp": {"load_s": 0.2, "load_source": "perf", "ready_s": 0.1, "peak_rss_mib": 180.0,
                            "peak_rss_m_c": 256}}]
    md = presets.preset_summary(points, files)
    lines = md.splitlines()
    assert lines[0] == "### Q4_K_M: a.gguf (100.5 MiB; tensors: Q5_0 166, Q4_K 16)"
    assert "| 256 | 1 | 100.0 | 80.0 (on) | 1.25x |" in lines
    assert "| 256 | 8 | 400.0 | 200.0 (off) | 2.00x |" in lines
    assert "peak RSS 500 MiB" in md and "baseline 350 MiB" in md and "+150 MiB" in md
    assert "llama.cpp: load 0.20 s" in md and "context ready 0.10 s" in md and "peak RSS 180 MiB" in md
    assert "b.gguf" not in md  # only the listed files


@pytest.mark.parametrize("preset", ["Q4_0"])
def test_real_quantizer_makes_the_preset(tmp_path, smollm2_gguf, preset):
    q = presets.quantize_binary(_built_binary())
    made = presets.make_preset(q, smollm2_gguf, preset, 2, folder=tmp_path)
    info = presets.file_info(Path(made["file"]))
    assert made["made"] and info["tensor_types"][preset]["tensors"] > 100 and info["file_mib"] > 10


IK_OUTPUT = """main: n_kv_max = 2304, n_batch = 2048, n_ubatch = 512, flash_attn = 0, is_pp_shared = 1, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|  1024 |     64 |    1 |   1088 |    2.048 |   500.00 |    0.400 |   160.00 |    2.448 |   444.44 |
|  1024 |     64 |    8 |   1536 |    2.048 |   500.00 |    1.600 |   320.00 |    3.648 |   421.05 |
llama_print_timings:        load time =     812.50 ms
"""


def test_ik_llama_cpp_flavor_command_and_table():
    """ik_llama.cpp's batched-bench: -rtr, no -kvu / JSON lines; its table parsed into the same rows."""
    from bench.llama_cpp import (batched_bench_command, flavor_of, parse_load_time_s, parse_table,
                                 to_point)

    binary = Path("/x/ik_llama.cpp/build/bin/llama-batched-bench")
    assert flavor_of(binary, {}) == "ik_llama.cpp" and flavor_of(Path("/x/llama.cpp/b"), {}) == "llama.cpp"
    assert flavor_of(Path("/x/b"), {"FORKLM_LLAMA_CPP_FLAVOR": "ik_llama.cpp"}) == "ik_llama.cpp"
    cmd = batched_bench_command(binary, Path("m.gguf"), 1024, [1, 8], 64, 2, True, "ik_llama.cpp")
    assert "-rtr" in cmd and "-kvu" not in cmd and "--output-format" not in cmd
    assert cmd[cmd.index("-fa") + 1] == "on" and "-pps" in cmd
    rows = [to_point(r, "cmd", "ik_llama.cpp") for r in parse_table(IK_OUTPUT)]
    assert [(r["m_c"], r["n"], r["impl"]) for r in rows] == [(1024, 1, "ik_llama.cpp"), (1024, 8, "ik_llama.cpp")]
    assert rows[1]["tokens_per_s"] == pytest.approx(8 * 64 / 1.6) and rows[0]["threads"] == 2
    assert parse_load_time_s(IK_OUTPUT) == pytest.approx(0.8125)
