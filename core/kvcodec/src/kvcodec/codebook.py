"""Codebook quantization: nearest reconstruction level in units of the group scale (normal-quantile codebooks).

A codebook is ``2**bits`` increasing levels ``c``; a group of ``G`` entries stores one scale ``s`` (its absolute
maximum over ``max |c|``) and per entry the index of the level nearest to ``x / s``; it dequantizes to
``(zero +) c[code] * s``. :func:`normal_codebook` gives the quantiles of the standard normal distribution, the
levels used for near-Gaussian data (NF4, Dettmers et al. 2023, "QLoRA", §3; HqeKV §3.1 normal-quantile codebooks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcodec.packing import PACK_BITS, pack_quantized, unpack_unchecked
from kvcodec.stats import expand_groups, resolve_group_size
from kvcore import QuantizedTensor
from kvcore.checks import check_finite, check_float, check_int, check_tensor
from kvcore.quantized import AXES, Axis


def normal_codebook(bits: int) -> torch.Tensor:
    """Standard-normal quantiles ``Φ⁻¹((i + 1/2) / 2**bits)`` for ``i < 2**bits``, float32, increasing, symmetric.

    Parameters
    ----------
    bits : int
        Code width, 1 to 8.
    """
    check_int("bits", bits, choices=PACK_BITS)
    n = 1 << bits
    p = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    return (torch.special.ndtri(p)).float()


def _check_codebook(codebook: torch.Tensor, bits: int) -> torch.Tensor:
    check_tensor("codebook", codebook, ndim=1)
    if codebook.numel() != 1 << bits or not codebook.is_floating_point():
        raise ValueError(
            f"codebook must be a float tensor of {1 << bits} levels, got {codebook.dtype} {tuple(codebook.shape)}"
        )
    if not bool(torch.isfinite(codebook).all()) or not bool((codebook[1:] > codebook[:-1]).all()):
        raise ValueError("codebook levels must be finite and strictly increasing")
    if float(codebook.abs().max()) == 0:
        raise ValueError("codebook must have a non-zero level")
    return codebook.float()


def nearest_level(y: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index (uint8) of the level of ``codebook`` (increasing) nearest to every element of ``y``; ties go down."""
    cb = codebook.to(y.device, torch.float32)
    mid = (cb[1:] + cb[:-1]) / 2
    return torch.bucketize(y.float().contiguous(), mid, right=False).to(torch.uint8)


def dequantize_codebook(q: QuantizedTensor) -> torch.Tensor:
    """``(zero +) codebook[code] * scale`` of a codebook ``QuantizedTensor``, in ``q.dtype`` (computed in float32)."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a kvcore.QuantizedTensor, got {type(q).__name__}")
    if q.codebook is None:
        raise ValueError("q has no codebook (uniform codes: use UniformQuantizer.dequantize)")
    cb = _check_codebook(q.codebook, q.bits)
    *lead, T, D = q.shape
    G = q.group_size
    gshape = (*lead, T, -(-D // G)) if q.axis == "token" else (*lead, -(-T // G), D)
    for name, t in (("scales", q.scales), ("zeros", q.zeros)):
        if t is not None and tuple(t.shape) != gshape:
            raise ValueError(f"q.{name} must have shape {gshape}, got {tuple(t.shape)}")
    codes = unpack_unchecked(q.codes, q.bits, D).long()
    y = cb.to(codes.device)[codes] * expand_groups(q.scales.float(), q.axis, G, T, D)
    if q.zeros is not None:
        y = y + expand_groups(q.zeros.float(), q.axis, G, T, D)
    fmax = torch.finfo(q.dtype).max
    return y.clamp_(-fmax, fmax).to(q.dtype)


@dataclass(frozen=True)
class CodebookQuantizer:
    """Zero-centred codebook quantizer of ``[..., T, D]`` tensors, implementing ``kvcore.Quantizer``.

    Per group: ``scale = max |x| / max |codebook|`` (stored in the input dtype), ``code`` = the level nearest to
    ``x / scale``; dequantized as ``codebook[code] * scale``. The error of an element inside the codebook's range is
    at most half the gap between its two neighbouring levels (times the scale).

    Parameters
    ----------
    bits : int
        Code width, 1 to 8.
    axis : {"token", "channel"}
        Grouping direction (as :class:`~kvcodec.UniformQuantizer`).
    group_size : int
        ``G >= 1``.
    codebook : Tensor, optional
        ``[2**bits]`` increasing levels; default :func:`normal_codebook` (``bits``).
    """

    bits: int = 4
    axis: Axis = "token"
    group_size: int = 32
    codebook: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        check_int("bits", self.bits, choices=PACK_BITS)
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        resolve_group_size((1, 1), self.axis, self.group_size)
        cb = normal_codebook(self.bits) if self.codebook is None else _check_codebook(self.codebook, self.bits)
        object.__setattr__(self, "codebook", cb)

    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize ``x [..., T, D]`` (floating, finite) to the nearest levels."""
        check_finite("x", check_float("x", check_tensor("x", x)))
        if x.ndim < 2:
            raise ValueError(f"x must have rank >= 2 ([..., T, D]), got shape {tuple(x.shape)}")
        *lead, T, D = x.shape
        G = self.group_size
        xf = x.float()
        a = xf.abs()
        if self.axis == "token":
            n = -(-D // G)
            amax = torch.nn.functional.pad(a, (0, n * G - D)).reshape(*lead, T, n, G).amax(-1)
        else:
            n = -(-T // G)
            amax = torch.nn.functional.pad(a, (0, 0, 0, n * G - T)).reshape(*lead, n, G, D).amax(-2)
        cb = self.codebook.to(x.device)
        scale = (amax / cb.abs().max()).to(x.dtype)
        s = expand_groups(scale.float(), self.axis, G, T, D)
        y = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
        codes = nearest_level(y, cb)
        return pack_quantized(codes, scale, None, bits=self.bits, axis=self.axis, group_size=G, like=x, codebook=cb)

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor:
        """``codebook[code] * scale`` (plus ``zeros`` when present) in ``q.dtype``; see :func:`dequantize_codebook`."""
        return dequantize_codebook(q)
