"""Peak memory of a block of work: CUDA allocator peak on GPU, peak RSS (Linux ``VmHWM``) on CPU."""

from __future__ import annotations

import contextlib
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


@dataclass
class Peak:
    """Bytes above the level at entry (``None`` where the platform cannot tell)."""

    bytes: int | None = None


@contextlib.contextmanager
def peak_memory(device: torch.device | str = "cpu"):
    """Measure the peak extra memory of the enclosed block.

    On CUDA this is ``torch.cuda.max_memory_allocated`` above the allocation at entry. On Linux CPUs the
    kernel's peak-RSS counter is reset (``echo 5 > /proc/self/clear_refs``) and read back (``VmHWM``),
    so the figure includes allocator slack; elsewhere it is ``None``.
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
    base = _rss_kb("VmRSS")
    try:
        _CLEAR.write_text("5")
        ok = base is not None
    except OSError:
        ok = False
    yield peak
    hwm = _rss_kb("VmHWM") if ok else None
    peak.bytes = None if hwm is None else max(0, (hwm - base) * 1024)
