"""Uniform asymmetric min-max quantization with explicit grouping (KIVI; HqeKV §3.1 Eq. 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kvcodec.kernels.dispatch as _kernels
from kvcodec.packing import pack_quantized
from kvcodec.stats import QUANT_BITS, expand_groups, minmax_scale, minmax_stats, resolve_group_size, scale_dtype_for
from kvcore import QuantizedTensor
from kvcore.checks import check_finite, check_float, check_int, check_tensor
from kvcore.quantized import AXES, Axis


@dataclass(frozen=True)
class UniformQuantizer:
    """Min-max quantizer of ``[..., T, D]`` tensors, implementing ``kvcore.Quantizer``.

    Per group: ``zero = min``, ``scale ~ (max - min) / (2**bits - 1)``, ``code = round((x - zero) / scale)``
    (Liu et al. 2024, "KIVI", §3; HqeKV §3.1 Eq. 1). The exact rounding of ``zero`` and ``scale`` is
    :mod:`kvcodec.stats`; it guarantees ``|x - dequantize(quantize(x))| <= scale/2`` per element
    (plus the rounding of the output dtype), no clamped code, and ``quantize(dequantize(q)).codes == q.codes``.

    Parameters
    ----------
    bits : int
        Code width, one of 1, 2, 3, 4, 8.
    axis : {"token", "channel"}
        ``"token"``: groups of ``group_size`` consecutive channels of one token (KIVI values), scales
        ``[..., T, ceil(D/G)]``. ``"channel"``: groups of ``group_size`` consecutive tokens of one channel
        (KIVI keys), scales ``[..., ceil(T/G), D]``. A partial last group is allowed.
    group_size : int
        ``G >= 1``; KIVI uses 32 (``example.py``), HF ``QuantizedLayer`` 64.

    Notes
    -----
    Codes are bit-packed densely along ``D`` (``kvcore.QuantizedTensor``; 8 codes in 3 bytes at 3 bits).
    Zeros are stored in the input dtype; scales in the input dtype as well, except float32 scales for bf16
    input at 8 bits (bf16 cannot resolve steps of 1/255; :func:`~kvcodec.stats.scale_dtype_for`).
    ``QuantizedTensor.nbytes`` is then exactly codes + scales + zeros. CUDA tensors run the fused Triton
    kernels of :mod:`kvcodec.kernels`, CPU tensors the PyTorch reference; both give identical codes.
    """

    bits: int = 2
    axis: Axis = "token"
    group_size: int = 32

    def __post_init__(self) -> None:
        check_int("bits", self.bits, choices=QUANT_BITS)
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        check_int("group_size", self.group_size, low=1)

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize ``x [..., T, D]`` (float32, float16 or bfloat16, finite)."""
        check_tensor("x", x)
        if x.ndim < 2:
            raise ValueError(f"x must have rank >= 2 ([..., T, D]), got shape {tuple(x.shape)}")
        check_float("x", x)
        check_finite("x", x)
        codes, scales, zeros = _kernels.quantize_pack(x, self.bits, self.axis, self.group_size)
        if scales.numel() and not bool(torch.isfinite(scales).all()):
            raise ValueError(
                f"x has a group range (max - min) too large for {scales.dtype} scales at bits={self.bits}; "
                "quantize it in float32"
            )
        return QuantizedTensor(
            codes=codes,
            scales=scales,
            zeros=zeros,
            bits=self.bits,
            axis=self.axis,
            group_size=self.group_size,
            shape=tuple(x.shape),
            dtype=x.dtype,
        )

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        """``zero + code * scale`` in ``q.dtype`` (computed in float32), shape ``q.shape``.

        Uses ``q``'s own bits, axis and group size, so any uniform ``QuantizedTensor`` is accepted.
        """
        if not isinstance(q, QuantizedTensor):
            raise TypeError(f"q must be a kvcore.QuantizedTensor, got {type(q).__name__}")
        if q.codebook is not None or q.zeros is None:
            raise ValueError("q is not a uniform min-max tensor (it has a codebook or no zeros)")
        *lead, T, D = q.shape
        G = q.group_size
        gshape = (*lead, T, -(-D // G)) if q.axis == "token" else (*lead, -(-T // G), D)
        if tuple(q.scales.shape) != gshape or tuple(q.zeros.shape) != gshape:
            raise ValueError(
                f"q.scales and q.zeros must have shape {gshape} for shape={q.shape}, axis={q.axis!r}, "
                f"group_size={G}; got {tuple(q.scales.shape)} and {tuple(q.zeros.shape)}"
            )
        return _kernels.unpack_dequantize(q.codes, q.scales, q.zeros, q.bits, q.axis, G, q.shape, q.dtype)


def quantize_minmax(
    x: torch.Tensor, bits: int, axis: str, group_size: int | None = None, ignore: torch.Tensor | None = None
) -> QuantizedTensor:
    """Uniform min-max quantization with whole-axis groups and masked statistics (PyTorch, any device).

    Same rule as :class:`UniformQuantizer` (``zero = min``, the scale rule of :mod:`kvcodec.stats`), with two
    extensions: ``group_size=None`` makes one group per token (``axis="token"``) or per channel
    (``axis="channel"``) over the whole axis, and entries where ``ignore`` is ``True`` do not enter the group
    statistics (HEX-style full-precision outliers kept elsewhere); their codes are clamped to ``[0, 2**bits - 1]``.
    Without ``ignore`` the result equals ``UniformQuantizer(bits, axis, G).quantize(x)`` bit for bit.
    ``UniformQuantizer.dequantize`` dequantizes the result.
    """
    check_int("bits", bits, choices=QUANT_BITS)
    check_finite("x", check_float("x", check_tensor("x", x)))
    G = resolve_group_size(tuple(x.shape), axis, group_size)
    stats = minmax_stats(x, axis, G, ignore)
    sdt = scale_dtype_for(x.dtype, bits)
    scale = minmax_scale(stats.span, bits, sdt)
    *_lead, T, D = x.shape
    zero = stats.lo.to(x.dtype)  # a group minimum: exact in x.dtype
    s, z = (expand_groups(t, axis, G, T, D) for t in (scale, zero.float()))
    codes = torch.round((x.float() - z) / s).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"x has a group range too large for {sdt} scales at bits={bits}; quantize it in float32")
    return pack_quantized(codes, scale.to(sdt), zero, bits=bits, axis=axis, group_size=G, like=x)
