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
BUILT = "BUILT"  # written after a build loaded: the binary's size and mtime, so a later process imports it directly
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
    ldflags, include_paths = list(ldflags or []), list(include_paths or [])
    directory = build_directory(name, build_key(source, cflags, ldflags, include_paths))
    failed = directory / FAILED
    if failed.exists() and os.environ.get("FORKLM_REBUILD") != "1":
        raise BuildError(f"{failed.read_text().strip()} (recorded in {directory}; delete it or set FORKLM_REBUILD=1 "
                         "to build again)")
    rebuild = os.environ.get("FORKLM_REBUILD") == "1"
    module = None if rebuild else _import_built(name, directory)
    if module is not None:
        return module
    from torch.utils.cpp_extension import load  # here: a finished build is imported without it

    directory.mkdir(parents=True, exist_ok=True)
    try:
        with _build_lock(directory):
            (directory / BUILT).unlink(missing_ok=True)
            module = load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=ldflags,
                          extra_include_paths=include_paths, build_directory=str(directory),
                          verbose=os.environ.get("FORKLM_VERBOSE_BUILD") == "1")
            _record_built(name, directory)
            failed.unlink(missing_ok=True)  # a rebuild (FORKLM_REBUILD=1) that worked: no stale verdict left
            return module
    except Exception as e:  # noqa: BLE001 - the compiler's or linker's failure, recorded and reported
        reason = _one_line(e)
        if isinstance(e, (ImportError, OSError)):  # a binary that could not be opened: not the build's verdict
            raise BuildError(reason) from e
        try:
            failed.write_text(reason + "\n")
        except OSError:
            pass
        raise BuildError(f"{reason} (recorded in {directory})") from e


def _binary(name: str, directory: Path) -> Path:
    return directory / f"{name}.so"  # torch.utils.cpp_extension's name for a Python module on Linux / macOS


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def _record_built(name: str, directory: Path) -> None:
    try:
        (directory / BUILT).write_text(_stamp(_binary(name, directory)) + "\n")
    except OSError:  # a read-only cache: the next process goes through torch's loader, as this one did
        pass


def _import_built(name: str, directory: Path):
    """The module a finished build left in `directory`, imported without torch's build machinery
    (importing torch.utils.cpp_extension and running ninja's check cost about 0.15 s per process), or
    None where no build finished there or the binary changed since (then `load` decides)."""
    import importlib.util

    binary = _binary(name, directory)
    try:
        if (directory / BUILT).read_text().strip() != _stamp(binary):
            return None
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(name, binary)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (ImportError, OSError):  # torch's loader tries again and reports what it finds
        return None
    return module


def warn_once(kernel: str, reason: str, fallback: str) -> None:
    """A kernel that should run here and does not: said once per process, naming it and the cause."""
    if kernel in _warned:
        return
    _warned.add(kernel)
    warnings.warn(f"forklm: the {kernel} kernel is not available ({reason}); {fallback}", RuntimeWarning, stacklevel=3)
