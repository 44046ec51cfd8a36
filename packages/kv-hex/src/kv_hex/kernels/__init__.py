"""HEX's hot operations: a PyTorch reference (the CPU path) and a Triton kernel with the same signature for each,
picked by :mod:`kv_hex.kernels.dispatch` (Triton for CUDA tensors when Triton is installed)."""

from kv_hex.kernels.dispatch import attention_column_sums, dequantize_part, kcvt_codes, part_attention

__all__ = ["attention_column_sums", "dequantize_part", "kcvt_codes", "part_attention"]
