"""The host's half of an alignment hint: whether a kernel may be told that rows start 16-element aligned.

A Triton kernel specialises its integer arguments itself (one divisible by 16 is marked so), but strides left
unspecialised on purpose -- they grow with a cache, and each new value would compile a variant -- are opaque to the
compiler, which then loads a row element by element (on sm_90 one 16-bit load each). Where the host has checked
those strides are multiples of 16 and the base address is 16-byte aligned, the kernel rewrites them as
``x // 16 * 16`` (exact for such strides) under a compile-time ``ALIGNED`` flag, and rows load as vectors.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["rows_aligned"]


def rows_aligned(tensors: Iterable[torch.Tensor], dims: Iterable[int] | None = None) -> bool:
    """Whether every tensor's base address is 16-byte aligned and its strides along ``dims`` (default: every
    dimension but the last) are multiples of 16 elements: what a kernel's ``ALIGNED`` hint promises."""
    for t in tensors:
        ds = range(t.ndim - 1) if dims is None else dims
        if t.data_ptr() % 16 or any(t.stride(d) % 16 for d in ds):
            return False
    return True
