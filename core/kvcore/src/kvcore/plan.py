"""A selection plan: the tier of every cache entry."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.checks import check_tensor

EVICT = 0
"""Tier value of an evicted entry (holds no memory)."""
FULL = 16
"""Tier value of an entry kept in full precision (the input dtype, read back bit-exact)."""
TIERS = frozenset({EVICT, *range(1, 9), FULL})
"""Tier values a plan may hold: evict, a quantized width of 1 to 8 bits, or full precision."""


@dataclass(frozen=True)
class Plan:
    """Per-entry tiers for keys and values, as bit widths.

    Parameters
    ----------
    key_bits : Tensor
        ``[B, Hkv, T]`` (or ``[L, B, Hkv, T]``) uint8: ``0`` evict, ``16`` full precision, otherwise the
        quantized width (1, 2, 3, 4, 8 ...).
    value_bits : Tensor, optional
        Same for values; ``None`` = same as ``key_bits``.
    full_precision : Tensor, optional
        ``[B, Hkv, T, D]`` bool element-level mask of entries to keep in full precision inside quantized
        tokens (HEX outliers).
    """

    key_bits: torch.Tensor
    value_bits: torch.Tensor | None = None
    full_precision: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor("key_bits", self.key_bits, ndim=(3, 4))
        if self.key_bits.dtype != torch.uint8:
            raise TypeError(f"key_bits must be uint8, got {self.key_bits.dtype}")
        if self.value_bits is not None and (
            self.value_bits.shape != self.key_bits.shape or self.value_bits.dtype != torch.uint8
        ):
            raise ValueError(f"value_bits must be uint8 of shape {tuple(self.key_bits.shape)}")
        sides = [(n, b) for n, b in (("key_bits", self.key_bits), ("value_bits", self.value_bits)) if b is not None]
        # one host read for both sides: uint8 tiers outside 0-8 and 16
        if any(b.numel() for _, b in sides) and bool(
            torch.stack([((b > 8) & (b != FULL)).any() for _, b in sides]).any()
        ):
            for name, bits in sides:
                bad = set(torch.unique(bits).tolist()) - TIERS
                if bad:
                    raise ValueError(f"{name} holds {sorted(bad)}; tiers are 0 (evict), 1-8 (bits) or 16 (full)")
        if self.full_precision is not None:
            check_tensor("full_precision", self.full_precision, ndim=self.key_bits.ndim + 1)
            if self.full_precision.dtype != torch.bool or self.full_precision.shape[:-1] != self.key_bits.shape:
                raise ValueError("full_precision must be a bool tensor [*key_bits.shape, D]")

    @classmethod
    def from_keep(cls, keep: torch.Tensor, keep_values: torch.Tensor | None = None) -> Plan:
        """An eviction-only plan: kept entries at full precision, others evicted."""
        kb = torch.where(keep, FULL, EVICT).to(torch.uint8)
        vb = None if keep_values is None else torch.where(keep_values, FULL, EVICT).to(torch.uint8)
        return cls(kb, vb)

    @property
    def bits_for_values(self) -> torch.Tensor:
        return self.key_bits if self.value_bits is None else self.value_bits

    @property
    def keep_keys(self) -> torch.Tensor:
        """Bool mask of key entries kept (any tier but evict)."""
        return self.key_bits != EVICT

    @property
    def keep_values(self) -> torch.Tensor:
        return self.bits_for_values != EVICT

    def tiers(self) -> set[int]:
        """Bit widths used by this plan."""
        return set(torch.unique(self.key_bits).tolist()) | set(torch.unique(self.bits_for_values).tolist())

    def average_bits(self, valid: torch.Tensor | None = None) -> float:
        """Mean bits per entry over keys and values (evicted = 0 bits), over ``valid`` tokens (``[B, T]``)."""
        bits = torch.stack([self.key_bits, self.bits_for_values]).float()
        if valid is None:
            return float(bits.mean())
        mask = valid[:, None, :].expand(self.key_bits.shape)
        return float(bits[:, mask].mean())
