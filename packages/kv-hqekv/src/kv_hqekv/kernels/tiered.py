"""What the HqeKV kernels read: one side (keys or values) of a mixed-tier cache, addressed through index maps.

A :class:`TieredSide` holds the full-precision rows of a side, the packed code table of each quantized tier
(:class:`TierCodes`: 4- and 2-bit uniform min-max, 1-bit normalized with its Gaussian-quantile codebook), and
per-entry maps of one common shape ``[..., T]`` saying where each entry lives: ``tier`` (``0`` none, ``16`` the
full row ``row``, ``b`` code row ``row`` of tier ``b`` with group parameter row ``group``). The maps of the keys and
of the values share one token order, so a token whose key and value sit in different tiers (HqeKV ranks them
separately, §3.3) is still one index: a kernel gathers its key from one tier and its value from another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcore.checks import check_int, check_tensor
from kvcore.quantized import AXES

TIER_BITS: tuple[int, ...] = (4, 2, 1)
"""The quantized tiers a :class:`TieredSide` may hold (HqeKV §3.4); ``16`` is the full-precision tier."""

FULL_TIER = 16
NO_ENTRY = 0


@dataclass(frozen=True)
class TierCodes:
    """The packed codes of one quantized tier of one side.

    Parameters
    ----------
    codes : Tensor
        uint8 ``[N, ceil(D·bits/8)]`` packed code rows (the ``kvcore.QuantizedTensor`` bit layout).
    scales, zeros : Tensor
        ``[Ng, C]`` group parameters (``C = D`` for ``axis="channel"``, ``ceil(D/G)`` for ``axis="token"``). Uniform
        tiers: ``zero + code·scale``; normalized tiers: ``zero + codebook[code]·scale`` (zero = mean, scale = std).
    bits : int
        1, 2 or 4.
    codebook : Tensor, optional
        float32 ``[2**bits]`` reconstruction levels of a normalized tier; ``None`` for uniform codes.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    codebook: torch.Tensor | None = None

    @classmethod
    def of(cls, units, bits: int) -> TierCodes:
        """The code table of a :class:`kvcodec.ragged.QuantUnits` tier: its code rows and unit statistics in use
        (viewed, not copied); the codebook for the 1-bit tier."""
        return cls(
            units.codes[: units.nr],
            units.scales[: units.nu].flatten(1),
            units.zeros[: units.nu].flatten(1),
            bits,
            units.codebook if bits == 1 else None,
        )

    def __post_init__(self) -> None:
        check_tensor("codes", self.codes, ndim=2)
        check_tensor("scales", self.scales, ndim=2)
        check_tensor("zeros", self.zeros, ndim=2)
        if self.codes.dtype != torch.uint8:
            raise TypeError(f"codes must be uint8, got {self.codes.dtype}")
        check_int("bits", self.bits, choices=TIER_BITS)
        if self.scales.shape != self.zeros.shape:
            raise ValueError(f"scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} must match")
        if self.codebook is not None:
            check_tensor("codebook", self.codebook, ndim=1)
            if self.codebook.numel() != 1 << self.bits:
                raise ValueError(f"codebook must hold {1 << self.bits} levels, got {self.codebook.numel()}")


@dataclass(frozen=True)
class TieredSide:
    """Keys or values of a mixed-tier cache (module doc).

    Parameters
    ----------
    full : Tensor
        ``[F, D]`` full-precision rows in the cache dtype (float32, float16 or bfloat16); sets ``D`` and the dtype
        every code row is dequantized to (``zero + code·scale`` in float32, clamped to the dtype's range, rounded).
    tiers : dict[int, TierCodes]
        The code table of each quantized tier present (keyed by bits).
    tier, row, group : Tensor
        Index maps of one shape ``[..., T]``: ``tier`` uint8 (0, 16 or a key of ``tiers``), ``row`` and ``group``
        int32 (``group`` ignored for full rows).
    axis : {"channel", "token"}
        Grouping of the code tables (``"channel"``: a parameter row covers all ``D`` channels of a group of entries,
        HqeKV keys; ``"token"``: a parameter row per entry, column ``d // group_size``, HqeKV values).
    group_size : int
        ``G`` (channels per group for ``axis="token"``).
    """

    full: torch.Tensor
    tiers: dict[int, TierCodes]
    tier: torch.Tensor
    row: torch.Tensor
    group: torch.Tensor
    axis: str
    group_size: int
    _dtype: torch.dtype = field(init=False, repr=False)

    def __post_init__(self) -> None:
        check_tensor("full", self.full, ndim=2)
        if self.full.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"full must be float32, float16 or bfloat16 (the cache dtype), got {self.full.dtype}")
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        check_int("group_size", self.group_size, low=1)
        check_tensor("tier", self.tier)
        if self.tier.dtype != torch.uint8:
            raise TypeError(f"tier must be uint8, got {self.tier.dtype}")
        for name in ("row", "group"):
            t = check_tensor(name, getattr(self, name))
            if t.shape != self.tier.shape or t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32 of shape {tuple(self.tier.shape)}, got {t.dtype} {t.shape}")
        D = self.head_dim
        C = D if self.axis == "channel" else -(-D // self.group_size)
        for b, t in self.tiers.items():
            if not isinstance(t, TierCodes) or t.bits != b:
                raise ValueError(f"tiers[{b}] must be a TierCodes of {b} bits")
            if t.codes.shape[1] != (D * b + 7) // 8 or t.scales.shape[1] != C:
                raise ValueError(f"tiers[{b}]: codes must be [N, {(D * b + 7) // 8}] and scales [Ng, {C}] for D={D}")
        object.__setattr__(self, "_dtype", self.full.dtype)

    @property
    def head_dim(self) -> int:
        return self.full.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        """The cache dtype code rows are dequantized to."""
        return self._dtype
