"""forklm's benchmarks and A/B measurements: a package of the source checkout, beside forklm/ and not in
the wheel. Run `python -m bench --help` from the checkout's root (the `bench` extra installs what they
need beyond forklm's own dependencies); one-off studies run as `python -m bench.<module>`."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def child_env(**overrides: str) -> dict[str, str]:
    """os.environ for a `python -m bench.<module>` child process, with the checkout's root first on
    PYTHONPATH so the child finds this package whatever its working directory; `overrides` set more."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT) + (os.pathsep + path if path else ""), **overrides}
