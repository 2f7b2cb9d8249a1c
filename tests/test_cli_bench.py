"""The benchmarks live in the source checkout's top-level bench/ package, not in forklm: `python -m bench`
runs them, `forklm bench ...` forwards there from a checkout (and says where they are otherwise), and
nothing under forklm/ imports them."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import forklm.cli
from forklm.cli import main

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ["sweep", "serve", "kernel", "constrained", "spec", "budget"]


def test_bench_cli_has_the_benchmark_commands():
    from bench.cli import build_parser

    parser = build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    assert list(sub.choices) == COMMANDS
    for name in COMMANDS:
        assert parser.parse_args([name]).command == name


def test_forklm_keeps_the_engine_commands():
    parser = forklm.cli.build_parser()
    [sub] = [a for a in parser._actions if a.dest == "command"]
    assert list(sub.choices) == ["sample", "info", "serve", "bench"]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench-serve"])  # the old names are gone: `forklm bench serve` / `python -m bench serve`


def test_forklm_bench_help_forwards(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: forklm bench ") and all(name in out for name in COMMANDS)


def test_forklm_bench_forwards_the_arguments(tmp_path, capsys):
    assert main(["bench", "spec", "--model", str(tmp_path), "--drafters", "magic"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forklm bench: error:") and "drafter" in err


def test_forklm_bench_outside_a_checkout_says_where(monkeypatch, capsys):
    monkeypatch.setattr(forklm.cli, "_source_checkout", lambda: None)  # an installed wheel: no bench/ beside forklm/
    assert main(["bench", "sweep", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python -m bench" in err and "Traceback" not in err


def test_python_m_bench_and_forklm_bench_from_elsewhere(tmp_path):
    """`python -m bench` from the checkout's root; `python -m forklm bench` from any directory."""
    done = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m bench "), done.stderr
    done = subprocess.run([sys.executable, "-m", "forklm", "bench", "sweep", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage: forklm bench sweep "), done.stderr


def test_import_forklm_pulls_in_no_benchmark():
    code = ("import sys, forklm, forklm.cli; forklm.cli.build_parser(); "
            "print([m for m in sys.modules if m == 'bench' or m.startswith('bench.')])")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_no_file_under_forklm_imports_bench():
    assert not (ROOT / "forklm" / "bench").exists()
    offenders = []
    for path in sorted((ROOT / "forklm").rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text, str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path}: {n}" for n in names if n == "bench" or n.startswith("bench.")]
        if "import_module(\"bench" in text and path != ROOT / "forklm" / "cli.py":  # cli.py's forwarder only
            offenders.append(f"{path}: import_module")
    assert offenders == []


def test_the_wheel_holds_the_engine_only():
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(ROOT), include=find["include"])
    assert "forklm" in packages and "forklm.server" in packages
    assert not [p for p in packages if not p.startswith("forklm")]
