"""Host data to a device without waiting for it.

``torch.tensor(values, device="cuda")`` builds the tensor in pageable host memory, copies it and then synchronises
the stream: the host waits for every kernel queued before it, like a read of a device value. :func:`from_host`
builds the tensor on the host, pins it where the device is a CUDA device and copies it asynchronously; PyTorch's
pinned-memory allocator keeps the host buffer alive until the copy is done, so the caller may drop it at once.
On the CPU it is ``torch.tensor``.

Examples
--------
>>> import torch
>>> from kvcore.transfer import from_host
>>> from_host([3, 1, 2], torch.device("cpu"))
tensor([3, 1, 2])
>>> from_host([0.5], "cpu", dtype=torch.float16).dtype
torch.float16
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["from_host"]


def from_host(
    data: Sequence | float | int | bool, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``data`` (Python numbers, possibly nested sequences) as a tensor on ``device``, copied without a host sync.

    Parameters
    ----------
    data : sequence or number
        What :func:`torch.tensor` accepts, except a tensor (use ``.to`` for that).
    device : torch.device or str
        The destination.
    dtype : torch.dtype, optional
        The tensor's dtype (default: inferred as :func:`torch.tensor` does).

    Returns
    -------
    torch.Tensor
        The data on ``device``; on a CUDA device the copy may still be in flight (stream-ordered, so every kernel
        launched after it on the current stream sees the data).

    Raises
    ------
    TypeError
        ``data`` is a tensor.
    """
    if isinstance(data, torch.Tensor):
        raise TypeError("from_host copies Python data; data is already a tensor (use .to(device))")
    device = torch.device(device)
    host = torch.tensor(data, dtype=dtype)
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
