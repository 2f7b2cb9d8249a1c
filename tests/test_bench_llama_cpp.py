"""llama.cpp as a `forklm bench` peer: parsing llama-batched-bench's output, the command it runs, the
missing-binary error, and (where scripts/build_llama_cpp.sh has built it) a real tiny run."""

import json
from pathlib import Path

import pytest

from forklm.bench import llama_cpp
from forklm.bench.llama_cpp import (LlamaCppNotFound, LlamaCppPeer, batched_bench_command, context_size, find_binary,
                                    parse_jsonl, to_point)
from forklm.bench.sweep import markdown_table
from forklm.cli import main

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
    rc = main(["bench", "--llama-cpp", "--contexts", "16", "--ns", "1", "--out", str(tmp_path / "x.json")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("forklm: error:") and "scripts/build_llama_cpp.sh" in err and "Traceback" not in err
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
    rc = main(["bench", "--llama-cpp", "--model", f"random:{config}", "--dtype", "float32", "--device", "cpu",
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
    rc = main(["bench", "--llama-cpp", "--dtype", "float32", "--device", "cpu", "--contexts", "32", "--ns", "1,2",
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
