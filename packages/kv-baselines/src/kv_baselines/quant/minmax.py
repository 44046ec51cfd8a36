"""The min-max scale rule shared by the PyTorch reference and the Triton kernels.

Uniform asymmetric min-max quantization (KIVI; HqeKV §3.1 Eq. 1): per group, ``zero = min`` and
``scale ~ (max - min) / (2**b - 1)``, ``code = round((x - zero) / scale)``. The details below make three
properties hold *exactly*, including float rounding:

* **No clamping, error <= scale/2.** ``zero`` is the group minimum itself (exactly representable in the
  input dtype). The scale is rounded to its storage dtype, then raised by one unit in the last place while
  ``fl((max - zero) / scale) >= 2**b - 1/2``, so every ``round((x - zero) / scale)`` is in ``[0, 2**b - 1]``
  and ``|x - (zero + code*scale)| <= scale/2``. (So ``(max - zero)/scale`` may exceed ``2**b - 1`` by less
  than one half; the code of the maximum is still ``2**b - 1``.)
* **Idempotence, quantize(dequantize(q)) == q.** The stored scale is ``(max - min)/(2**b - 1)`` rounded to
  *nearest*: requantizing the dequantized group sees ``max' ~ zero + (2**b - 1)*scale`` and rounds back to the
  same scale, whereas rounding up would put ``max'`` at the upper edge of the scale's rounding interval and
  flip it half of the time. This needs the scale dtype to resolve steps of ``1/(2**b - 1)``: fp16 and bf16
  scales do for b <= 4 and fp16 for b = 8, but bf16's 8-bit significand cannot resolve 1/255, so 8-bit
  quantization of bf16 tensors stores fp32 scales (:func:`scale_dtype_for`).
* **No division by zero.** Scales never go below ``2**b`` subnormal steps of an fp16 scale (2**-126 for
  bf16 and fp32 scales): constant groups get that tiny scale, code 0 and zero error, and a scale is always
  fine enough that ``ulp(scale) / scale <= 2**-b``.

All arithmetic is float32 with IEEE division and round-half-to-even, so the Triton kernels reproduce the
reference bit for bit (they use ``div_rn`` and are compiled without FMA contraction).
"""

from __future__ import annotations

import torch

QUANT_BITS: tuple[int, ...] = (1, 2, 3, 4, 8)
"""Bit widths of :class:`~kv_baselines.quant.UniformQuantizer`."""

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def scale_dtype_for(dtype: torch.dtype, bits: int) -> torch.dtype:
    """Storage dtype of the scales for an input of ``dtype`` quantized at ``bits``.

    The input dtype for fp16 and bf16, float32 for fp32 inputs, and float32 for bf16 at 8 bits (see the
    module docstring). Zeros are always stored in the input dtype (they are exact group minima).
    """
    if dtype == torch.float32 or (dtype == torch.bfloat16 and bits > 4):
        return torch.float32
    return dtype


def scale_floor(scale_dtype: torch.dtype, bits: int) -> float:
    """Smallest scale the rule produces: ``2**bits`` subnormal steps for fp16, the smallest normal otherwise."""
    if scale_dtype == torch.float16:
        return 2.0 ** (bits - 24)
    return 2.0**-126


def next_up(s: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Next representable value of ``scale_dtype`` above the positive float32 values ``s`` (as float32)."""
    as_int = s.to(scale_dtype).view(_INT_VIEW[scale_dtype])
    return (as_int + 1).view(scale_dtype).float()


def minmax_scale(span: torch.Tensor, bits: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Stored scales for group ranges ``span = max - min`` (float32, finite, >= 0), returned as float32.

    Every returned value is exactly representable in ``scale_dtype``.
    """
    levels = float((1 << bits) - 1)
    s = (span / levels).to(scale_dtype).float()
    s = s.clamp_min(scale_floor(scale_dtype, bits))
    for _ in range(2):
        s = torch.where(span / s >= levels + 0.5, next_up(s, scale_dtype), s)
    return s
