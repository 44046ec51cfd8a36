"""One dispatch point for HEX's kernels: the Triton kernel for CUDA tensors when Triton is installed, the PyTorch
reference otherwise (the reference is the CPU path, not a test-only copy)."""

from __future__ import annotations

import torch

from kv_hex.kernels import reference

__all__ = ["attention_column_sums", "decode_attention", "kcvt_codes", "triton_available", "use_triton"]


def triton_available() -> bool:
    """Triton is importable."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernel for ``t``: a CUDA tensor with Triton installed."""
    return t.is_cuda and triton_available()


def kcvt_codes(x, use, bits, axis):
    """:func:`kv_hex.kernels.reference.kcvt_codes`, or its Triton version (statistics reduced in Triton) on CUDA."""
    if use_triton(x):
        from kv_hex.kernels.triton_kcvt import kcvt_codes_triton

        return kcvt_codes_triton(x, use, bits, axis)
    return reference.kcvt_codes(x, use, bits, axis)


def attention_column_sums(queries, keys, valid, scale, chunk: int = 256):
    """:func:`kv_hex.kernels.reference.attention_column_sums`, or its Triton kernel on CUDA (power-of-two head dims
    >= 16)."""
    D = keys.shape[-1]
    if use_triton(keys) and D >= 16 and not D & (D - 1):
        from kv_hex.kernels.triton_colsum import attention_column_sums_triton

        return attention_column_sums_triton(queries, keys, valid, scale)
    return reference.attention_column_sums(queries, keys, valid, scale, chunk)


def decode_attention(query, keys, values, bias, scale):
    """:func:`kv_hex.kernels.reference.decode_attention` over the dense view on every device: the fused Triton
    kernel over codes + overlay + full rows + residual is not built yet."""
    return reference.decode_attention(query, keys, values, bias, scale)
