"""One loader for forklm's C++ kernels (torch.utils.cpp_extension builds on first use).

Each build lives in forklm's own cache directory (FORKLM_CACHE_DIR, else $XDG_CACHE_HOME/forklm, else
~/.cache/forklm), in a folder named by a hash of everything the binary depends on: the source and
every file beside it (the headers it includes), its path, the compiler flags, torch's version and
Python's. Two checkouts therefore never rebuild each other's kernels, and a process
never imports a binary built from other sources. A build that fails leaves its reason in that
folder (`FAILED`): later processes report it without retrying (delete the folder, or set
FORKLM_REBUILD=1, to try again), and each process says it once, as a warning naming the kernel.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

FAILED = "FAILED"
_warned: set[str] = set()


class BuildError(RuntimeError):
    """A kernel that did not build here; the message is the cause (one line)."""


def cache_root() -> Path:
    env = os.environ.get("FORKLM_CACHE_DIR")
    if env:
        return Path(env).expanduser() / "extensions"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "forklm" / "extensions"


def build_key(source: Path, cflags: list[str], ldflags: list[str], include_paths: list[str]) -> str:
    """A hash of what the binary depends on (the sources beside `source` included)."""
    h = hashlib.sha256()
    for f in sorted(source.parent.glob("*.[ch]*")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    # the source's absolute path too: torch's build file names it, so two checkouts sharing one folder would
    # rewrite it in turn and rebuild each other's binaries
    for part in (str(source.resolve()), *cflags, "|", *ldflags, "|", *include_paths, torch.__version__, sys.version,
                 platform.machine()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


def build_directory(name: str, key: str) -> Path:
    return cache_root() / f"{name}-{key}"


@contextmanager
def _build_lock(directory: Path):
    """Held while a process builds or loads `directory`'s extension: an flock, which the kernel drops
    when its holder dies. torch's own lock file is a plain file that a build killed half-way leaves
    behind, and torch's next build waits on it forever; whoever holds this lock knows no live process
    is building there, so such a file is stale and removed."""
    with open(directory / "forklm.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1] if text else ''}"


def load_extension(name: str, source: Path, cflags: list[str], ldflags: list[str] | None = None,
                   include_paths: list[str] | None = None):
    """The built module `name` from `source` (built here on the first call on this machine), or
    BuildError with the cause, recorded so that no later process retries the same build."""
    from torch.utils.cpp_extension import load

    ldflags, include_paths = list(ldflags or []), list(include_paths or [])
    directory = build_directory(name, build_key(source, cflags, ldflags, include_paths))
    failed = directory / FAILED
    if failed.exists() and os.environ.get("FORKLM_REBUILD") != "1":
        raise BuildError(f"{failed.read_text().strip()} (recorded in {directory}; delete it or set FORKLM_REBUILD=1 "
                         "to build again)")
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(directory):
            return load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=ldflags,
                        extra_include_paths=include_paths, build_directory=str(directory),
                        verbose=os.environ.get("FORKLM_VERBOSE_BUILD") == "1")
    except Exception as e:  # noqa: BLE001 - the compiler's or linker's failure, recorded and reported
        reason = _one_line(e)
        if isinstance(e, (ImportError, OSError)):  # a binary that could not be opened: not the build's verdict
            raise BuildError(reason) from e
        try:
            failed.write_text(reason + "\n")
        except OSError:
            pass
        raise BuildError(f"{reason} (recorded in {directory})") from e


def warn_once(kernel: str, reason: str, fallback: str) -> None:
    """A kernel that should run here and does not: said once per process, naming it and the cause."""
    if kernel in _warned:
        return
    _warned.add(kernel)
    warnings.warn(f"forklm: the {kernel} kernel is not available ({reason}); {fallback}", RuntimeWarning, stacklevel=3)
