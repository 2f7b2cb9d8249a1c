"""Peak memory of one call: `with PeakMemory(device) as mem: ...; mem.peak_mib`.

On CPU a background thread samples the process's resident set size (/proc/self/statm) every
`interval_s` seconds while the block runs; the result is the highest sample minus the RSS just
before the block, in MiB. On CUDA it is `torch.cuda.max_memory_allocated` minus the allocated
bytes before the block (the caching allocator's reserve is not counted).

On CPU, before the baseline is read, garbage is collected and glibc is asked to hand freed heap
memory back to the OS (malloc_trim), so that memory the allocator kept from earlier calls is not
reused silently. What remains cached elsewhere (PyTorch's, or another allocator's, pools) still
makes small deltas read low: treat the CPU figure as a lower bound.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time

import torch

_MIB = 2**20


def current_rss_bytes() -> int:
    """Resident set size of this process in bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def release_freed_heap() -> None:
    """Collects garbage and returns glibc's free heap pages to the OS (no-op without glibc)."""
    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Context manager measuring the peak memory a block adds (bytes and MiB)."""

    def __init__(self, device: torch.device | str = "cpu", interval_s: float = 0.002) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.base_bytes = 0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ CPU sampler
    def _sample_rss(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base_bytes = self.peak_bytes = torch.cuda.memory_allocated(self.device)
            return self
        release_freed_heap()
        self.base_bytes = self.peak_bytes = current_rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample_rss, name="forklm-peak-rss", daemon=True)
        self._thread.start()
        time.sleep(0)  # let the sampler take its first reading
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device))
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, current_rss_bytes())

    @property
    def delta_bytes(self) -> int:
        """Peak minus the baseline taken on entry, in bytes (never negative)."""
        return max(0, self.peak_bytes - self.base_bytes)

    @property
    def peak_mib(self) -> float:
        """Peak minus the baseline taken on entry, in MiB."""
        return self.delta_bytes / _MIB
