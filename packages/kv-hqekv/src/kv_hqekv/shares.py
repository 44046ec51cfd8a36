"""Tier shares: the Eq. 3 budget solver, the published shares (Table 9) and block counts with rounding repair.

HqeKV gives every planned block one of five actions — fp16, 4-bit uniform, 2-bit uniform, 1-bit normalized,
evict (§3.3-3.4). Outside the ``fp16_blocks`` most important blocks, the shares ``δ = (δ1, δ2, δ3, δ4)`` of the
4-bit, 2-bit, 1-bit and evict tiers satisfy Eq. 3: ``4δ1 + 2δ2 + δ3 = B_avg`` and ``δ1 + δ2 + δ3 + δ4 = 1``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvcore.checks import check_int, check_number

TIER_BITS: tuple[int, ...] = (4, 2, 1, 0)
"""Bit widths of the shared tiers, in the order of :class:`Shares` (0 = evict)."""

TOLERANCE = 5e-3
"""Slack on ``Σδ = 1`` and on the average bits: Table 9 prints shares to 3-4 digits (Llama-3.25 sums to 1.0003)."""


@dataclass(frozen=True)
class Shares:
    """Shares of the 4-bit, 2-bit, 1-bit and evict tiers outside the fp16 blocks (HqeKV §3.3, Eq. 3).

    Parameters
    ----------
    q4, q2, q1, evict : float
        Non-negative shares ``δ1 .. δ4`` summing to 1 (within :data:`TOLERANCE`; they are renormalised).
    """

    q4: float
    q2: float
    q1: float
    evict: float

    def __post_init__(self) -> None:
        values = [check_number(name, getattr(self, name), low=0.0, high=1.0) for name in ("q4", "q2", "q1", "evict")]
        total = sum(values)
        if abs(total - 1.0) > TOLERANCE:
            raise ValueError(f"shares (q4, q2, q1, evict) must sum to 1, got {values} (sum {total:.4f})")
        for name, v in zip(("q4", "q2", "q1", "evict"), values):
            object.__setattr__(self, name, v / total)

    @property
    def avg_bits(self) -> float:
        """Code bits per entry outside the fp16 blocks: ``4δ1 + 2δ2 + δ3`` (Eq. 3)."""
        return 4 * self.q4 + 2 * self.q2 + self.q1

    def as_tuple(self) -> tuple[float, float, float, float]:
        return (self.q4, self.q2, self.q1, self.evict)

    def check_bits(self, avg_bits: float) -> None:
        """Raise ``ValueError`` unless these shares give ``avg_bits`` (within :data:`TOLERANCE`)."""
        if abs(self.avg_bits - avg_bits) > TOLERANCE:
            raise ValueError(
                f"shares {self.as_tuple()} give {self.avg_bits:.4f} average bits, not the budget's avg_bits={avg_bits}"
            )


def solve_eq3(avg_bits: float, x3: float, x4: float) -> tuple[float, float]:
    """``(δ1, δ2)`` from Eq. 3 given the 1-bit share ``x3`` and the evict share ``x4`` (Alg. 1 l.7-8).

    ``δ1 = (B - 2 + x3 + 2·x4) / 2`` and ``δ2 = (4 - B - 3·x3 - 4·x4) / 2``; the paper's Alg. 1 drops the ``/2``
    (a typo: without it the shares do not satisfy Eq. 3). The pair is feasible iff both are ``>= 0``
    (:func:`feasible`).
    """
    b = check_number("avg_bits", avg_bits, low=0.0, high=4.0)
    x3 = check_number("x3", x3, low=0.0, high=1.0)
    x4 = check_number("x4", x4, low=0.0, high=1.0)
    return (b - 2 + x3 + 2 * x4) / 2, (4 - b - 3 * x3 - 4 * x4) / 2


def feasible(avg_bits: float, x3: float, x4: float) -> Shares | None:
    """The :class:`Shares` Eq. 3 gives for ``(x3, x4)``, or ``None`` when ``δ1 < 0`` or ``δ2 < 0`` (infeasible)."""
    d1, d2 = solve_eq3(avg_bits, x3, x4)
    if d1 < 0 or d2 < 0:
        return None
    return Shares(d1, d2, x3, x4)


PRESETS: dict[str, Shares] = {
    "llama-2": Shares(0.0315, 0.922, 0.0299, 0.0165),
    "llama-2.8": Shares(0.416, 0.568, 0.0012, 0.0153),
    "llama-3.2": Shares(0.637, 0.307, 0.037, 0.0186),
    "llama-3.25": Shares(0.679, 0.225, 0.0847, 0.0116),
    "qwen3-2": Shares(0.164, 0.672, 0.0006, 0.164),
    "qwen3-2.8": Shares(0.659, 0.081, 0.001, 0.259),
    "qwen3-3.2": Shares(0.778, 0.0431, 0.0009, 0.178),
}
"""The shares the paper's search found (Table 9; Llama-3.1-8B-Instruct and Qwen3-8B)."""


def preset(name: str) -> Shares:
    """A Table 9 preset by name (``"llama-2"``, ``"qwen3-3.2"`` ...); ``ValueError`` lists the names."""
    if name not in PRESETS:
        raise ValueError(f"unknown HqeKV preset {name!r}; presets are {sorted(PRESETS)}")
    return PRESETS[name]


def load_shares(path: str | Path) -> Shares:
    """The shares of a file written by ``kv-hqekv search`` (kv-lab's ratio search)."""
    data = json.loads(Path(path).read_text())
    return Shares(**data["shares"])


@dataclass(frozen=True)
class TierCounts:
    """Blocks per tier of one plan: fp16, 4-bit, 2-bit, 1-bit, evict (they sum to the planned blocks)."""

    fp16: int
    q4: int
    q2: int
    q1: int
    evict: int

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.fp16, self.q4, self.q2, self.q1, self.evict)

    @property
    def blocks(self) -> int:
        return sum(self.as_tuple())

    @property
    def code_bits(self) -> float:
        """Achieved code bits per entry outside the fp16 blocks (Eq. 3's left-hand side); 0 with none."""
        rest = self.blocks - self.fp16
        return (4 * self.q4 + 2 * self.q2 + self.q1) / rest if rest else 0.0

    @property
    def avg_bits(self) -> float:
        """Achieved bits per planned entry, fp16 blocks included (16 bits each)."""
        return (16 * self.fp16 + 4 * self.q4 + 2 * self.q2 + self.q1) / self.blocks if self.blocks else 0.0


def tier_counts(n_blocks: int, shares: Shares, fp16_blocks: int = 2) -> TierCounts:
    """Blocks per tier for ``n_blocks`` planned blocks (the authors' ``make_sum_equal``).

    ``min(fp16_blocks, n)`` blocks are fp16; the other ``n'`` get ``round(n'·δ)`` blocks per tier. The sum is
    repaired by adjusting the 1-bit count first, spilling into the 2-bit, 4-bit and fp16 counts when it would go
    negative; the evict count is never adjusted. With fewer blocks than ``fp16_blocks`` everything is fp16
    (the authors' code produces negative counts below 64 tokens).
    """
    n = check_int("n_blocks", n_blocks, low=0)
    check_int("fp16_blocks", fp16_blocks, low=0)
    if not isinstance(shares, Shares):
        raise TypeError(f"shares must be kv_hqekv.Shares, got {type(shares).__name__}")
    n16 = min(fp16_blocks, n)
    rest = n - n16
    c = [n16] + [math.floor(rest * s + 0.5) for s in shares.as_tuple()]  # round half up, as Python's round is not
    c[4] = min(c[4], rest)
    diff = n - sum(c)  # > 0: too few blocks assigned; < 0: too many
    order = (3, 2, 1, 0)  # 1-bit first, then 2-bit, 4-bit, fp16
    if diff > 0:
        c[3] += diff
    else:
        for i in order:
            take = min(c[i], -diff)
            c[i] -= take
            diff += take
            if diff == 0:
                break
    return TierCounts(*c)
