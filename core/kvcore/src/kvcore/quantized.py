"""A quantized tensor: densely bit-packed codes plus their grouping metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvcore.checks import check_int, check_tensor

Axis = Literal["token", "channel"]
AXES: tuple[str, ...] = ("token", "channel")


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes of a ``[..., T, D]`` tensor, bit-packed densely along ``D`` (8 / bits codes per byte).

    Parameters
    ----------
    codes : Tensor
        uint8 ``[..., T, ceil(D * bits / 8)]``; code ``j`` of a row occupies bits ``j*bits .. j*bits+bits-1``
        of the row's little-endian bit stream.
    scales : Tensor
        Per group: ``[..., T, ceil(D / G)]`` for ``axis="token"`` (groups of G channels of one token, KIVI
        values), ``[..., ceil(T / G), D]`` for ``axis="channel"`` (groups of G tokens of one channel, KIVI keys).
    zeros : Tensor, optional
        Group offsets (the minimum, for asymmetric min-max), same shape as ``scales``; ``None`` for
        zero-centred codebooks.
    bits : int
        Code width.
    axis : {"token", "channel"}
        Grouping direction, see ``scales``.
    group_size : int
        ``G``.
    shape : tuple of int
        Shape of the original tensor.
    dtype : torch.dtype
        dtype of the original tensor (what ``dequantize`` returns).
    codebook : Tensor, optional
        ``[2**bits]`` reconstruction levels in units of the group scale (normal-quantile codebooks, HqeKV);
        ``None`` for uniform codes ``zero + code * scale``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    axis: Axis
    group_size: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    codebook: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.uint8:
            raise TypeError(f"codes must be uint8, got {self.codes.dtype}")
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        check_int("bits", self.bits, low=1, high=8)
        check_int("group_size", self.group_size, low=1)
        if len(self.shape) < 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in self.shape):
            raise ValueError(f"shape must be a tuple of >= 2 non-negative ints [..., T, D], got {self.shape}")
        *lead, T, D = self.shape
        expected = (*lead, T, packed_width(D, self.bits))
        if tuple(self.codes.shape) != expected:
            raise ValueError(f"codes must have shape {expected} for shape={self.shape}, bits={self.bits}")
        G = self.group_size
        groups = (*lead, T, -(-D // G)) if self.axis == "token" else (*lead, -(-T // G), D)
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if t is None and name == "zeros":
                continue
            check_tensor(name, t)
            if tuple(t.shape) != groups:
                raise ValueError(
                    f"{name} must have shape {groups} for {self.axis}-axis groups of {G}, got {tuple(t.shape)}"
                )

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes + scales + zeros (+ codebook)."""
        parts = [self.codes, self.scales, self.zeros, self.codebook]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def device(self) -> torch.device:
        return self.codes.device


def packed_width(d: int, bits: int) -> int:
    """Bytes per packed row of ``d`` codes of ``bits`` bits."""
    return (d * bits + 7) // 8
