"""The one kernel dispatch decision of kvcompress: Triton for CUDA tensors when triton is installed, the PyTorch
reference for everything else (the reference is the CPU path, not a test-only copy).

Every package's dispatch (:mod:`kvcodec.kernels.dispatch`, ``kv_hex.kernels.dispatch``, ``kv_hqekv.kernels.dispatch``,
``kv_sekv.kernels.dispatch``, ``kv_hubkv.refine`` ...) imports :func:`use_triton` from here; none decides on its own.
It lives in kvcore, not kvcodec, because a method package may depend on kvcore alone (kv-hubkv). Each importing
module binds the name, so a test (or ``benchmarks/decode_census.py``) can force the Triton path of one module with
``monkeypatch.setattr(module, "use_triton", lambda t: True)`` and run it under ``TRITON_INTERPRET=1`` on CPU tensors.

``import kvcore`` never imports triton: :func:`triton_available` tries the import on its first call.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["triton_available", "use_triton"]


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` can be imported (tried once per process).

    Returns
    -------
    bool
        ``True`` when ``import triton`` succeeds.
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether a kernel over ``t`` takes the Triton path.

    Parameters
    ----------
    t : torch.Tensor
        The tensor whose device decides (a kernel's main input).

    Returns
    -------
    bool
        ``True`` for a CUDA tensor with triton installed; ``False`` otherwise (the PyTorch reference runs).

    Examples
    --------
    >>> import torch
    >>> use_triton(torch.zeros(2))
    False
    """
    return t.is_cuda and triton_available()
