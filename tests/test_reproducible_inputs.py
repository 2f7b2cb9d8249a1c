"""Test inputs repeat from one run to the next: no random seed is derived from `hash()`, which
Python salts per process for strings (PYTHONHASHSEED), so such a seed changes every run."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_builtin_hash_calls():
    found = []
    for folder in ("forklm", "tests", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hash":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"hash() is salted per process; use zlib.crc32 or hashlib: {found}"
