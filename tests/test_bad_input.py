"""Every bad input gets a clear error naming what was wrong; the CLI prints one line, no traceback."""

import subprocess
import sys

import pytest

from forklm import LLM, InvalidArgumentError, ModelFileError, OutOfMemoryError, UnsupportedModelError


@pytest.fixture(scope="module")
def llm(smollm2_f32):
    return smollm2_f32


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"n": 0}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"attention": "flash"}, "attention"),
        ({"stop": [""]}, "stop"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stop_token_ids": [10**6], "min_tokens": 1}, "stop_token_ids"),
        ({"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_sampling_arguments(llm, kwargs, name):
    with pytest.raises(InvalidArgumentError, match=name) as e:
        llm.sample("hello", **kwargs)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("prompt", ["", [], [-1], [10**9], [1, "a"], {"role": "user"}, None])
def test_bad_prompts(llm, prompt):
    with pytest.raises(InvalidArgumentError, match="prompt"):
        llm.sample(prompt)


def test_bad_chat_messages(llm):
    with pytest.raises(InvalidArgumentError):
        llm.sample([{"role": "user"}])  # no content


def test_prompt_plus_max_tokens_beyond_context(llm):
    limit = llm.config.max_position_embeddings
    with pytest.raises(InvalidArgumentError, match=f"context length of {limit}"):
        llm.sample("hello", max_tokens=limit)


def test_n_too_large_for_memory_is_refused_before_allocating(llm):
    with pytest.raises(OutOfMemoryError, match=r"needs about .* GiB .* only .* GiB"):
        llm.sample("hello", n=10**7, max_tokens=1000)


def test_unknown_model_name():
    with pytest.raises(InvalidArgumentError, match="unknown model 'gpt-17'"):
        LLM("gpt-17")


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        LLM(str(tmp_path / "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))  # an empty folder


def test_corrupt_gguf(tmp_path, smollm2_gguf):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(smollm2_gguf.read_bytes()[:5000])
    with pytest.raises(ModelFileError, match="broken.gguf"):
        LLM(str(bad))


def test_unsupported_file_type_and_architecture(tmp_path):
    f = tmp_path / "model.onnx"
    f.write_bytes(b"12345")
    with pytest.raises(UnsupportedModelError, match=".onnx"):
        LLM(str(f))
    (tmp_path / "config.json").write_text('{"architectures": ["BertForMaskedLM"], "hidden_size": 8}')
    with pytest.raises(UnsupportedModelError, match="BertForMaskedLM"):
        LLM(str(tmp_path))


def test_bad_dtype_and_device():
    with pytest.raises(InvalidArgumentError, match="dtype"):
        LLM("smollm2-135m", dtype="int8")
    with pytest.raises(InvalidArgumentError, match="float16"):
        LLM("smollm2-135m", dtype="float16", device="cpu")
    with pytest.raises(InvalidArgumentError, match="device"):
        LLM("smollm2-135m", device="tpu")


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "forklm", *args], capture_output=True, text=True, input=stdin, timeout=300)


def test_cli_errors_are_one_line_without_traceback(smollm2_gguf):
    r = run_cli("sample", "-n", "0", "hi")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "n must be" in lines[0]
    r = run_cli("sample", "--model", "no-such-model", "hi")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "unknown model" in r.stderr


def test_cli_sample_json_and_stdin(smollm2_gguf):
    import json

    r = run_cli("sample", "-n", "3", "--max-tokens", "5", "--seed", "1", "--json", "--dtype", "float32", "-", stdin="def f(x):")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["samples"]) == 3 and doc["seed"] == 1
    assert all(len(s["token_ids"]) == len(s["logprobs"]) <= 5 for s in doc["samples"])


def test_cli_sample_speculative_and_time_budget(smollm2_gguf):
    """`forklm sample --speculative` gives the samples of a plain run (float32 dense: the exact
    path); `--time-budget` ends them with finish reason "time"; a bad spec is one clear line."""
    import json

    common = ["sample", "-n", "2", "--max-tokens", "12", "--seed", "3", "--json", "--dtype", "float32",
              "--quantize", "none", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]
    plain, spec = run_cli(*common), run_cli(*common, "--speculative", "ngram:3")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert [s["token_ids"] for s in json.loads(spec.stdout)["samples"]] == \
        [s["token_ids"] for s in json.loads(plain.stdout)["samples"]]
    r = run_cli("sample", "-n", "2", "--max-tokens", "5000", "--time-budget", "0.5", "--json", "--dtype", "float32",
                "def f(x):")
    assert r.returncode == 0, r.stderr
    assert {s["finish_reason"] for s in json.loads(r.stdout)["samples"]} <= {"time", "stop"}
    r = run_cli("sample", "--speculative", "ngram:zero", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "ngram:K" in r.stderr


def test_cli_help_everywhere():
    for args in (["--help"], ["sample", "--help"], ["bench", "--help"]):
        r = run_cli(*args)
        assert r.returncode == 0 and "usage: forklm" in r.stdout


def test_tiny_temperature_is_greedy_not_garbage(llm):
    """Dividing logits by 1e-320 overflows float32; such temperatures draw greedily."""
    greedy = llm.sample("def fib(n):", n=2, max_tokens=8, temperature=0)
    tiny = llm.sample("def fib(n):", n=2, max_tokens=8, temperature=1e-320, seed=3)
    assert [s.token_ids for s in tiny.samples] == [s.token_ids for s in greedy.samples]
