"""Min-max group statistics, and the scale rule shared by the PyTorch reference and the Triton kernels.

:func:`minmax_stats` gives per-group minima and maxima of ``[..., T, D]`` tensors for any group size, whole-axis
groups (``group_size=None``) and masked entries (ignored by the statistics: the full-precision outliers of HEX-style
methods). The rest of this module is the exact scale rule:

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

from dataclasses import dataclass

import torch

from kvcore.checks import check_bool_mask, check_float, check_int, check_tensor
from kvcore.quantized import AXES

QUANT_BITS: tuple[int, ...] = (1, 2, 3, 4, 8)
"""Bit widths of :class:`~kvcodec.UniformQuantizer`."""

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


@dataclass(frozen=True)
class MinMaxStats:
    """Per-group minima and maxima (float32), shaped like ``QuantizedTensor.scales``.

    ``count`` is the number of entries that entered each group's statistics (masked entries excluded); groups
    with ``count == 0`` have ``lo == hi == 0``.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    count: torch.Tensor
    group_size: int

    @property
    def span(self) -> torch.Tensor:
        """``hi - lo``."""
        return self.hi - self.lo


def resolve_group_size(shape: tuple[int, ...], axis: str, group_size: int | None) -> int:
    """``group_size``, or the length of the grouped axis for whole-axis groups (``None``); at least 1."""
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    if group_size is None:
        return max(1, shape[-1] if axis == "token" else shape[-2])
    return check_int("group_size", group_size, low=1, optional="whole axis")


def minmax_stats(
    x: torch.Tensor, axis: str, group_size: int | None = None, ignore: torch.Tensor | None = None
) -> MinMaxStats:
    """Group minima and maxima of ``x [..., T, D]`` (KIVI §3; HqeKV §3.1 Eq. 1 statistics).

    Parameters
    ----------
    x : Tensor
        Floating ``[..., T, D]``.
    axis : {"token", "channel"}
        ``"token"``: groups of ``group_size`` consecutive channels of one token (stats ``[..., T, ceil(D/G)]``);
        ``"channel"``: groups of ``group_size`` consecutive tokens of one channel (stats ``[..., ceil(T/G), D]``).
    group_size : int, optional
        ``G >= 1``; a partial last group is allowed. ``None`` = whole-axis groups (``G`` = D or T).
    ignore : Tensor, optional
        Bool mask shaped like ``x``; ``True`` entries do not affect the statistics (full-precision outliers).

    Returns
    -------
    MinMaxStats
        float32 ``lo``/``hi`` and int64 ``count`` per group.
    """
    check_float("x", check_tensor("x", x))
    if x.ndim < 2:
        raise ValueError(f"x must have rank >= 2 ([..., T, D]), got shape {tuple(x.shape)}")
    G = resolve_group_size(tuple(x.shape), axis, group_size)
    if ignore is not None:
        ignore = check_bool_mask("ignore", ignore, tuple(x.shape))
        if ignore.device != x.device:
            raise ValueError(f"ignore is on {ignore.device} but x is on {x.device}")
    *lead, T, D = x.shape
    xf = x.float().reshape(-1, T, D)
    keep = torch.ones_like(xf, dtype=torch.bool) if ignore is None else ~ignore.reshape(-1, T, D)
    M = xf.shape[0]
    if axis == "token":
        n = -(-D // G)
        pad = n * G - D
        xf, keep = torch.nn.functional.pad(xf, (0, pad)), torch.nn.functional.pad(keep, (0, pad))
        xg, kg, rdim, gshape = xf.view(M, T, n, G), keep.view(M, T, n, G), -1, (*lead, T, n)
    else:
        n = -(-T // G)
        pad = n * G - T
        xf, keep = torch.nn.functional.pad(xf, (0, 0, 0, pad)), torch.nn.functional.pad(keep, (0, 0, 0, pad))
        xg, kg, rdim, gshape = xf.view(M, n, G, D), keep.view(M, n, G, D), -2, (*lead, n, D)
    lo = torch.where(kg, xg, float("inf")).amin(rdim)
    hi = torch.where(kg, xg, float("-inf")).amax(rdim)
    count = kg.sum(rdim)
    empty = count == 0
    lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    return MinMaxStats(lo.reshape(gshape), hi.reshape(gshape), count.reshape(gshape), G)


def expand_groups(g: torch.Tensor, axis: str, group_size: int, T: int, D: int) -> torch.Tensor:
    """Per-group values ``g`` (shaped like ``QuantizedTensor.scales``) broadcast to every element ``[..., T, D]``."""
    if axis == "token":
        return g.repeat_interleave(group_size, -1)[..., :D]
    return g.repeat_interleave(group_size, -2)[..., :T, :]
