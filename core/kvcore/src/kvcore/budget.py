"""How much of the cache to keep."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kvcore.checks import check_int, check_number, check_ratio

Granularity = Literal["head", "layer", "global"]
GRANULARITIES: tuple[str, ...] = ("head", "layer", "global")


@dataclass(frozen=True)
class Budget:
    """A keep budget, as a ratio removed or as a token count, at one granularity.

    Parameters
    ----------
    ratio : float, optional
        Fraction of tokens *removed*, in [0, 1) (0.0 keeps everything). Exclusive with ``tokens``.
    tokens : int, optional
        Tokens kept per KV head (on average per head for ``"layer"`` / ``"global"``). Exclusive with ``ratio``.
    granularity : {"head", "layer", "global"}
        Where the kept count is exact: every head keeps ``kept(n)``; every layer keeps ``H * kept(n)`` spread
        over its heads; the whole model keeps ``L * H * kept(n)``.
    avg_bits : float, optional
        Average bits per cached entry for tiered selection (HqeKV Eq. 3), evicted entries counting 0 bits.
    """

    ratio: float | None = None
    tokens: int | None = None
    granularity: Granularity = "head"
    avg_bits: float | None = None

    def __post_init__(self) -> None:
        if self.ratio is not None and self.tokens is not None:
            raise ValueError("Budget takes either ratio or tokens, not both")
        if self.ratio is None and self.tokens is None and self.avg_bits is None:
            object.__setattr__(self, "ratio", 0.0)
        if self.ratio is not None:
            object.__setattr__(self, "ratio", check_ratio("ratio", self.ratio))
        if self.tokens is not None:
            check_int("tokens", self.tokens, low=1)
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if self.avg_bits is not None:
            object.__setattr__(self, "avg_bits", check_number("avg_bits", self.avg_bits, low=0.0, high=16.0))

    def kept(self, n: int) -> int:
        """Entries kept per head out of ``n``: ``floor(n * (1 - ratio))`` or ``min(tokens, n)``."""
        if self.tokens is not None:
            return min(self.tokens, n)
        ratio = 0.0 if self.ratio is None else self.ratio
        return min(n, math.floor(n * (1.0 - ratio) + 1e-9))
