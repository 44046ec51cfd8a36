"""Equal-bytes comparisons: pick, for one method, the budget whose held KV bytes come closest to a target.

Methods that evict and methods that quantize mean different bytes by "ratio"; comparing them at equal *bytes
actually held* in the fast tier (``CompressedCache.resident_nbytes()``: ``nbytes()`` for every store except one that
offloads on purpose, such as SEKV's span bases in host memory) is the fair axis. The search runs over the budget
kinds the method's registry entry takes (average bits first, then ratio, then tokens): a coarse grid of candidates,
walked in order until two successive ones bracket the target, then interpolation steps (regula falsi) between them
until one lands within ``tolerance`` of it. Every candidate is measured, never predicted,
so scales, zero points, positions and container overheads are counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

from kvcore import Budget
from kvcore.registry import Method

__all__ = ["Match", "match_budget"]

_GRIDS: dict[str, list[float]] = {
    "avg_bits": [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0],
    "ratio": [0.0, 0.25, 0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99],
}


@dataclass(frozen=True)
class Match:
    """The chosen budget, the bytes per token it holds and the target."""

    budget: Budget
    bytes_per_token: float
    target: float
    tried: int

    @property
    def relative_error(self) -> float:
        return abs(self.bytes_per_token - self.target) / self.target


def _make(kind: str, value: float) -> Budget:
    if kind == "avg_bits":
        return Budget(avg_bits=value)
    if kind == "tokens":
        return Budget(tokens=max(1, round(value)))
    return Budget(ratio=value)


def match_budget(
    method: Method,
    target: float,
    measure: Callable[[Budget], float],
    *,
    context_tokens: int = 1000,
    steps: int = 6,
    tolerance: float = 0.005,
) -> Match:
    """The budget of ``method`` whose measured bytes per token are closest to ``target``.

    Parameters
    ----------
    method : kvcore.registry.Method
        Its ``budgets`` say which kinds may be searched; a method taking none is returned at its default.
    target : float
        Bytes of KV cache held per context token, > 0.
    measure : callable
        ``measure(budget) -> bytes per token`` held after compressing a calibration prompt (the same for every
        method); it may raise ``ValueError`` for a budget the method refuses (that candidate is skipped).
    context_tokens : int
        Length of the calibration prompt (bounds the token-budget search).
    steps : int
        Interpolation steps after the grid, at most.
    tolerance : float
        Relative distance from the target at which the search stops.

    Raises
    ------
    ValueError
        A non-positive target, or a method that refused every candidate.
    """
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not math.isfinite(target) or target <= 0:
        raise ValueError(f"target must be a finite number of bytes per token > 0, got {target!r}")
    if not method.budgets:
        return Match(method.default, measure(method.default), float(target), 1)
    kind = next(k for k in ("avg_bits", "ratio", "tokens") if k in method.budgets)
    grid = _GRIDS.get(kind) or sorted({max(1, round(context_tokens * f)) for f in (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)})
    seen: dict[float, float] = {}
    errors: list[str] = []

    def probe(value: float) -> float | None:
        if value not in seen:
            try:
                seen[value] = float(measure(_make(kind, value)))
            except ValueError as exc:
                errors.append(f"{kind}={value:g}: {exc}")
                return None
        return seen[value]

    last: float | None = None
    for v in grid:  # in order, until two successive measured candidates bracket the target
        b = probe(v)
        if b is None:
            continue
        if b == target or (last is not None and min(last, b) <= target <= max(last, b)):
            break
        last = b
    if not seen:
        raise ValueError(f"method {method.name!r} refused every {kind} budget tried: {errors[:3]}")
    pts = sorted(seen.items())
    for (v0, b0), (v1, b1) in pairwise(pts):
        if min(b0, b1) <= target <= max(b0, b1) and b0 != b1:
            lo, hi, blo, bhi = v0, v1, b0, b1
            for _ in range(steps):
                # regula falsi: held bytes are close to linear in the budget, so the interpolant lands near
                # the target; kept strictly inside the bracket (a bisection step when it would not move)
                mid = lo + (hi - lo) * (target - blo) / (bhi - blo)
                mid = min(max(mid, lo + (hi - lo) * 0.05), hi - (hi - lo) * 0.05)
                mid = round(mid) if kind == "tokens" else mid
                bm = probe(mid)
                if bm is None or mid in (lo, hi) or abs(bm - target) <= tolerance * target:
                    break
                if (bm - target) * (blo - target) > 0:
                    lo, blo = mid, bm
                else:
                    hi, bhi = mid, bm
            break
    value, held = min(seen.items(), key=lambda kv: abs(kv[1] - target))
    return Match(_make(kind, value), held, float(target), len(seen) + len(errors))
