"""Peak memory of one call: `with PeakMemory(device) as mem: ...; mem.peak_mib`.

On Linux the kernel keeps the process's peak resident set size (VmHWM in /proc/self/status);
writing "5" to /proc/self/clear_refs resets it to the current RSS, so the peak of a block is read
with no thread at all (nothing competes with the timed work for a core). Where that reset is not
allowed, a background thread samples the RSS every `interval_s` seconds instead. The result is
the peak minus the RSS just before the block, in MiB. On CUDA it is `torch.cuda.max_memory_allocated` minus the allocated
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


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS counter (VmHWM) to the current RSS; False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return peak_rss_bytes() > 0
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The kernel's peak resident set size of this process since the last reset (0 if unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


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
        self._kernel_peak = False

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
        self._kernel_peak = reset_peak_rss()
        if self._kernel_peak:
            return self
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
        if self._kernel_peak:
            self.peak_bytes = max(self.peak_bytes, peak_rss_bytes(), current_rss_bytes())
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
