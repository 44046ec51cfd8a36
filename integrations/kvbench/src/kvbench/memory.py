"""Peak memory of a block of work: CUDA allocator peak on GPU, peak RSS (Linux ``VmHWM``) on CPU."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _rss_kb(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


@functools.cache
def _libc_trim():
    """glibc's ``malloc_trim`` (``None`` on other C libraries)."""
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_memory() -> bool:
    """Hand the C allocator's free pages back to the OS (glibc ``malloc_trim(0)``); ``False`` where unsupported.

    Without it, memory freed by an earlier run stays resident and is reused, so a later run's peak-RSS rise
    reads near zero although it allocated as much.
    """
    fn = _libc_trim()
    if fn is None:
        return False
    fn(0)
    return True


@dataclass
class Peak:
    """Bytes above the level at entry (``None`` where the platform cannot tell)."""

    bytes: int | None = None


@contextlib.contextmanager
def peak_memory(device: torch.device | str = "cpu"):
    """Measure the peak extra memory of the enclosed block.

    On CUDA this is ``torch.cuda.max_memory_allocated`` above the allocation at entry. On Linux CPUs the
    allocator's free pages are first returned to the OS (:func:`release_free_memory`), then the kernel's peak-RSS
    counter is reset (``echo 5 > /proc/self/clear_refs``) and read back (``VmHWM``); the figure includes
    allocator slack and page-granular rounding. Elsewhere it is ``None``.
    """
    device = torch.device(device)
    peak = Peak()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield peak
        torch.cuda.synchronize(device)
        peak.bytes = torch.cuda.max_memory_allocated(device) - base
        return
    release_free_memory()
    base = _rss_kb("VmRSS")
    try:
        _CLEAR.write_text("5")
        ok = base is not None
    except OSError:
        ok = False
    yield peak
    hwm = _rss_kb("VmHWM") if ok else None
    peak.bytes = None if hwm is None else max(0, (hwm - base) * 1024)
