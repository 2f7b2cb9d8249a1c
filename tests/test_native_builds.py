"""forklm's native build loader (forklm/kernels/native.py): builds keyed by what they depend on, in
forklm's own cache, a failed build recorded and said once, the OpenMP rule read from the process."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from forklm.kernels import block_gemm, native

ROOT = Path(__file__).resolve().parent.parent

GOOD = """#include <torch/extension.h>
int64_t twice(int64_t x) { return 2 * x; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORKLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FORKLM_REBUILD", raising=False)
    return tmp_path / "cache" / "extensions"


def test_the_key_follows_sources_headers_flags_and_torch(tmp_path, monkeypatch):
    src = tmp_path / "k.cpp"
    src.write_text("int f() { return 1; }\n")
    header = tmp_path / "k.h"
    header.write_text("#define A 1\n")
    key = native.build_key(src, ["-O3"], [], [])
    assert native.build_key(src, ["-O3"], [], []) == key  # stable
    header.write_text("#define A 2\n")
    assert native.build_key(src, ["-O3"], [], []) != key  # a header it includes
    header.write_text("#define A 1\n")
    assert native.build_key(src, ["-O3", "-mavx512f"], [], []) != key  # flags (the ISA variant)
    assert native.build_key(src, ["-O3"], [], ["/other/ggml/include"]) != key
    other = tmp_path / "clone"
    other.mkdir()
    (other / "k.cpp").write_text(src.read_text())
    (other / "k.h").write_text(header.read_text())
    assert native.build_key(other / "k.cpp", ["-O3"], [], []) != key  # another checkout: its own build
    monkeypatch.setattr(torch, "__version__", "2.4.0+cpu")
    assert native.build_key(src, ["-O3"], [], []) != key  # another torch


def test_a_failed_build_is_recorded_said_once_and_not_retried(tmp_path, cache, monkeypatch):
    src = tmp_path / "broken.cpp"
    src.write_text("this is not C++\n")
    with pytest.raises(native.BuildError, match="recorded in"):
        native.load_extension("forklm_test_broken", src, ["-O0"])
    [folder] = list(cache.iterdir())
    assert (folder / native.FAILED).read_text().strip()
    import torch.utils.cpp_extension as ext

    def no_build(*a, **k):
        raise AssertionError("a recorded failure was built again")

    monkeypatch.setattr(ext, "load", no_build)
    with pytest.raises(native.BuildError, match="FORKLM_REBUILD=1"):
        native.load_extension("forklm_test_broken", src, ["-O0"])
    monkeypatch.setenv("FORKLM_REBUILD", "1")  # asked for: tried again
    with pytest.raises(native.BuildError, match="AssertionError"):
        native.load_extension("forklm_test_broken", src, ["-O0"])
    # the caller's report: one warning per process naming the kernel, the reason every time
    native._warned.discard("test kernel")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(3):
            why = block_gemm.cpu_extension_error(lambda: native.load_extension("forklm_test_broken", src, ["-O0"]),
                                                 "test kernel")
            assert why is not None and "AssertionError" in why
    if block_gemm.cpu_supports() and block_gemm._torch_uses_libgomp():
        mine = [str(w.message) for w in seen if "test kernel" in str(w.message)]
        assert len(mine) == 1 and "PyTorch's operators run instead" in mine[0]


def test_a_build_lives_in_forklms_cache_and_a_second_process_reuses_it(tmp_path, cache):
    src = tmp_path / "good.cpp"
    src.write_text(GOOD)
    code = ("import sys; from pathlib import Path; from forklm.kernels import native; "
            f"m = native.load_extension('forklm_test_twice', Path({str(src)!r}), ['-O1']); print(m.twice(21)); "
            "print('torch.utils.cpp_extension' in sys.modules)")
    env = {**__import__("os").environ, "FORKLM_CACHE_DIR": str(cache.parent)}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert first.returncode == 0 and first.stdout.split() == ["42", "True"], first.stderr
    [folder] = list(cache.iterdir())
    [so] = list(folder.glob("*.so"))
    built_at = so.stat().st_mtime_ns
    assert (folder / native.BUILT).exists()
    # a finished build is imported directly, without torch's build machinery (about 0.15 s a process)
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert second.returncode == 0 and second.stdout.split() == ["42", "False"], second.stderr
    assert so.stat().st_mtime_ns == built_at and list(cache.iterdir()) == [folder]  # not rebuilt
    # no record of a finished build (a build killed half-way), and torch's lock file as such a build leaves
    # it: torch's loader decides, without waiting on the stale lock forever, and the record is written again
    (folder / native.BUILT).unlink()
    (folder / "lock").touch()
    third = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert third.returncode == 0 and third.stdout.split() == ["42", "True"], third.stderr
    assert so.stat().st_mtime_ns == built_at and (folder / native.BUILT).exists()
    (folder / native.BUILT).write_text("0 0\n")  # a binary other than the one recorded: not imported directly
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert again.returncode == 0 and again.stdout.split() == ["42", "True"], again.stderr
    # a verdict recorded by an earlier failure (say, no compiler then): a rebuild that works removes it
    (folder / native.FAILED).write_text("RuntimeError: no compiler\n")
    rebuilt = subprocess.run([sys.executable, "-c", code], env={**env, "FORKLM_REBUILD": "1"}, capture_output=True,
                             text=True, timeout=600, cwd=ROOT)
    assert rebuilt.returncode == 0 and rebuilt.stdout.split()[0] == "42", rebuilt.stderr
    assert not (folder / native.FAILED).exists()
    src.write_text(GOOD.replace("2 * x", "2 * x + 0"))  # another version of the source: its own folder
    other = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert other.returncode == 0 and len(list(cache.iterdir())) == 2
    assert so.stat().st_mtime_ns == built_at  # the first version's build untouched


def test_the_openmp_rule_reads_the_runtime_torch_loaded():
    runtime = block_gemm.openmp_runtime()
    if (Path(torch.__file__).parent / "lib" / "libgomp.so.1").exists():
        assert runtime == "libgomp.so.1" and block_gemm._torch_uses_libgomp()
    else:  # a renamed copy (libgomp-<hash>.so.1) or another runtime: the kernels stay off, and say so
        assert not block_gemm._torch_uses_libgomp()
        assert block_gemm.cpu_extension_error(lambda: None, "test") is not None
