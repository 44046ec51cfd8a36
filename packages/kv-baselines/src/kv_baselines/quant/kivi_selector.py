"""KIVI's prefill layout as a tiered selection on top of any eviction selector."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcore import EVICT, FULL, Budget, Plan, Scores, Selector, TopKSelector
from kvcore.checks import check_int


def kivi_tiers(keep: torch.Tensor, bits: int, residual: int, kind: str) -> torch.Tensor:
    """Tiers of KIVI's prefill layout over the kept entries ``keep [..., T]`` of each head.

    Keys (``kind="keys"``): the last ``n mod residual`` kept entries full precision, the rest ``bits``
    (whole residual blocks are quantized per channel). Values: the last ``min(n, residual)`` kept entries full
    precision, the rest ``bits``. Evicted entries get ``EVICT``. Returns uint8 of ``keep``'s shape.
    """
    n = keep.sum(-1, keepdim=True)
    n_full = n % residual if kind == "keys" else n.clamp_max(residual)
    from_end = keep.flip(-1).cumsum(-1).flip(-1)  # kept entries at or after t
    tiers = torch.where(from_end <= n_full, FULL, bits)
    return torch.where(keep, tiers, EVICT).to(torch.uint8)


@dataclass(frozen=True)
class KIVITierSelector:
    """Evict with ``base``, then lay the kept entries of each head out as KIVI does at prefill.

    Among each head's kept entries (in token order): keys -- the last ``n_kept mod residual`` ``FULL`` and
    the rest ``bits``; values -- the last ``min(residual, n_kept)`` ``FULL`` and the rest ``bits``
    (Liu et al. 2024, "KIVI", Alg. 1). Paired with
    :class:`~kv_baselines.quant.KIVIStore` of the same ``residual``, the ``FULL`` entries are the store's
    residuals, so decoding continues exactly as KIVI's cache would.

    Parameters
    ----------
    base : kvcore.Selector
        Decides which entries are kept (its tiers are ignored, only kept vs evicted counts).
        ``TopKSelector()`` with ``Budget(ratio=0.0)`` keeps everything (plain KIVI).
    bits : int
        Quantized width of keys, 1 to 8.
    residual : int
        KIVI's residual length ``R`` (>= 1).
    value_bits : int, optional
        Quantized width of values; ``None`` = ``bits``.

    Attributes
    ----------
    plan_bits : frozenset of int
        ``{EVICT, FULL, bits, value_bits}`` (:class:`kvcore.PlanBits`): the tiers its plans hold.
    """

    base: Selector = field(default_factory=TopKSelector)
    bits: int = 2
    residual: int = 128
    value_bits: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.base, Selector):
            raise TypeError(f"base must implement kvcore.Selector, got {type(self.base).__name__}")
        for name in ("bits", "value_bits"):
            b = getattr(self, name)
            if name == "value_bits" and b is None:
                continue
            check_int(name, b, low=1, high=8)
        check_int("residual", self.residual, low=1)

    @property
    def plan_bits(self) -> frozenset[int]:
        """The tiers its plans may hold: ``EVICT``, ``FULL`` and the key and value widths."""
        return frozenset({EVICT, FULL, self.bits, self.bits if self.value_bits is None else self.value_bits})

    def select(
        self,
        scores: Scores,
        budget: Budget,
        protected: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> Plan:
        plan = self.base.select(scores, budget, protected, valid)
        vbits = self.bits if self.value_bits is None else self.value_bits
        return Plan(
            kivi_tiers(plan.keep_keys, self.bits, self.residual, "keys"),
            kivi_tiers(plan.keep_values, vbits, self.residual, "values"),
        )
