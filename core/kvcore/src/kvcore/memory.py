"""Byte accounting: what tensors really hold, counted by storage so views and slack are not hidden."""

from __future__ import annotations

from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor | None], device: torch.device | str | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (on ``device`` if given)."""
    want = None if device is None else torch.device(device)
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        if want is not None and (t.device.type != want.type or (want.index is not None and t.device != want)):
            continue
        st = t.untyped_storage()
        seen[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(seen.values())
