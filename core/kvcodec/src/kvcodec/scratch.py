"""Per-thread scratch buffers for decode-time temporaries on CPU.

A decode step's attention over a compressed cache needs working memory the size of the cache's unpacked codes
(like a full cache's attention temporaries): allocating it afresh every step costs more than the arithmetic on a
CPU, where each large allocation is a fresh ``mmap`` whose pages fault in again. :func:`scratch` hands out one
buffer per ``(name, dtype, device)`` and thread, grown when a call needs more and reused by every store and layer.
It is working memory, not held by any store, so no store counts it in ``nbytes()``.
"""

from __future__ import annotations

import threading

import torch

_local = threading.local()


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D per-thread scratch buffer of ``numel`` elements (grown when needed, reused across calls and stores).

    Its contents are whatever the last user left: callers overwrite (or zero) what they read. Two live uses of
    one ``name`` in the same thread share memory, so each concurrent temporary needs its own name.
    """
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = {}
    key = (name, dtype, str(device))
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        buf = pool[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]
