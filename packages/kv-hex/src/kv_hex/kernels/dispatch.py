"""HEX's kernels dispatched: the Triton kernel for CUDA tensors when Triton is installed, the PyTorch reference
otherwise (the reference is the CPU path, not a test-only copy). The decision is :func:`kvcore.dispatch.use_triton`,
bound here so a test can force this module's Triton path (``monkeypatch.setattr(dispatch, "use_triton", ...)``)."""

from __future__ import annotations

from kv_hex.kernels import reference
from kvcore.dispatch import triton_available, use_triton

#: Decode attention v2 (the folded formulation, :mod:`kv_hex.kernels.folded`) for the uniform calls on CUDA. Off by
#: default until a GPU run has checked the compiled kernel (``bash benchmarks/gpu_check.sh hextiers``); the CPU path
#: never takes it.
FOLDED_DECODE = False

__all__ = [
    "FOLDED_DECODE",
    "accumulate_attention",
    "attention_column_sums",
    "dequantize_part",
    "kcvt_codes",
    "part_attention",
    "triton_available",
    "uniform_attention",
    "use_triton",
]


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


def dequantize_part(part):
    """:func:`kv_hex.kernels.reference.dequantize_part`, or its Triton kernel (bit-identical) on CUDA."""
    if use_triton(part.k.idx):
        from kv_hex.kernels.triton_dequant import dequantize_part_triton

        return dequantize_part_triton(part)
    return reference.dequantize_part(part)


def part_attention(query, part, scale, logits=False):
    """:func:`kv_hex.kernels.reference.part_attention`, or the fused Triton decode-attention kernel on CUDA."""
    if use_triton(part.k.idx):
        from kv_hex.kernels.triton_attention import part_attention_triton

        return part_attention_triton(query, part, scale, logits)
    return reference.part_attention(query, part, scale, logits)


def uniform_attention(query, calls, scale):
    """:func:`kv_hex.kernels.reference.uniform_attention`, or the fused Triton kernel that addresses segments by
    arithmetic (:mod:`kv_hex.kernels.triton_uniform`: one launch per call, one merge) on CUDA; with
    :data:`FOLDED_DECODE`, the folded kernel (:mod:`kv_hex.kernels.triton_folded`) for the calls it takes."""
    if use_triton(calls[0].part.before):
        if FOLDED_DECODE:
            from kv_hex.kernels import triton_folded

            if triton_folded.supported(query, calls):
                return triton_folded.uniform_decode_v2_triton(query, calls, scale)
        from kv_hex.kernels.triton_uniform import uniform_attention_triton

        return uniform_attention_triton(query, calls, scale)
    return reference.uniform_attention(query, calls, scale)


def accumulate_attention(acc, logits, lse):
    """:func:`kv_hex.kernels.reference.accumulate_attention`, or its one-launch Triton kernel on CUDA."""
    if use_triton(logits):
        from kv_hex.kernels.triton_accumulate import accumulate_attention_triton

        return accumulate_attention_triton(acc, logits, lse)
    return reference.accumulate_attention(acc, logits, lse)
