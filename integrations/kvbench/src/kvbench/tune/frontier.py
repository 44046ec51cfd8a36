"""What ``kvbench tune`` concludes from its rows: the Pareto frontier, the winner at the target, its ties, and the
winner as a line of Python and a registry spec.

* Frontier: a row is on it when no other row holds no more bytes (fast tier, per context token) *and* is no worse
  (continuation KL lower, or task accuracy higher) with one of the two strictly better.
* ``--target`` / ``--target-bytes``: among the rows whose held bytes reach the target (within ``tolerance``), the
  winner has the lowest mean KL; a row is a *tie* when its per-window KL minus the winner's, paired on the same
  windows, has a 95% bootstrap interval that includes zero (or rests on fewer than
  :data:`kvbench.stats.MIN_PAIRS` windows: no difference is called then).
* ``--max-kl``: the winner is the smallest cache whose KL upper 95% bound is within the bound (a conservative
  reading: the mean alone would let a noisy row through); rows within ``tolerance`` of its bytes that qualify too are
  ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvbench.budgets import parse_budget
from kvbench.report import Row, resident_bytes_per_token
from kvbench.stats import paired_difference

__all__ = ["Choice", "choose_at_target", "choose_smallest", "pareto", "python_line", "registry_spec"]


def _ran(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if not r.error]


def pareto(rows: Sequence[Row], metric: str = "kl") -> list[Row]:
    """The rows on the bytes-vs-``metric`` Pareto frontier, by increasing bytes.

    Parameters
    ----------
    rows : sequence of Row
        Rows that ran (error rows are ignored), with ``kl`` (``metric="kl"``, lower is better) or task accuracy
        (``metric="accuracy"``, higher is better).
    metric : {"kl", "accuracy"}
    """
    if metric not in ("kl", "accuracy"):
        raise ValueError(f"metric must be 'kl' or 'accuracy', got {metric!r}")

    def loss(r: Row) -> float | None:
        return r.kl if metric == "kl" else (None if r.mean_accuracy is None else -r.mean_accuracy)

    pts = [(resident_bytes_per_token(r), loss(r), r) for r in _ran(rows) if loss(r) is not None]
    front = []
    for b, v, r in pts:
        dominated = any(b2 <= b and v2 <= v and (b2 < b or v2 < v) for b2, v2, _ in pts)
        if not dominated:
            front.append((b, v, r))
    return [r for _, _, r in sorted(front, key=lambda t: (t[0], t[1]))]


@dataclass
class Choice:
    """The winner (``None`` when no row qualified), the rows tied with it, and the rows that qualified at all."""

    winner: Row | None
    ties: list[Row] = field(default_factory=list)
    qualified: list[Row] = field(default_factory=list)
    reason: str = ""


def reaches(row: Row, target_bpt: float, tolerance: float) -> bool:
    """Whether ``row`` holds at most ``target_bpt`` bytes per context token (fast tier), ``tolerance`` relative."""
    return resident_bytes_per_token(row) <= target_bpt * (1.0 + tolerance)


def _compressing(rows: Sequence[Row]) -> list[Row]:
    return [r for r in _ran(rows) if r.method != "full" and r.kl is not None and r.window_kl]


def choose_at_target(rows: Sequence[Row], target_bpt: float, tolerance: float = 0.05, *, seed: int = 0) -> Choice:
    """The lowest-KL row among those reaching ``target_bpt``, and the rows not distinguishable from it.

    Parameters
    ----------
    rows : sequence of Row
        Paired rows (:func:`kvbench.paired.pair_rows`), with per-window KL.
    target_bpt : float
        Bytes per context token the cache may hold.
    tolerance : float
        Relative slack on the target (a bytes match is as close as the method's budgets allow).
    seed : int
        Bootstrap seed of the paired differences.
    """
    ok = [r for r in _compressing(rows) if reaches(r, target_bpt, tolerance)]
    if not ok:
        held = sorted(resident_bytes_per_token(r) for r in _compressing(rows))
        least = f"; the smallest cache evaluated held {held[0]:.0f} B/token" if held else ""
        return Choice(None, reason=f"no method held at most {target_bpt:.0f} B/token (+{tolerance:.0%}){least}")
    best = min(ok, key=lambda r: (r.kl, resident_bytes_per_token(r)))
    ties = []
    for r in ok:
        if r is best:
            continue
        d = paired_difference(r.window_kl, best.window_kl, seed=seed)
        if not d.significant:
            ties.append(r)
    return Choice(best, ties, ok)


def choose_smallest(rows: Sequence[Row], max_kl: float, tolerance: float = 0.05) -> Choice:
    """The row holding the fewest bytes whose KL 95% upper bound is at most ``max_kl``, and those within
    ``tolerance`` of its bytes that qualify too."""
    ok = [r for r in _compressing(rows) if r.kl_ci is not None and r.kl_ci.high <= max_kl]
    if not ok:
        return Choice(None, reason=f"no compressed cache kept its KL 95% upper bound within {max_kl:g} nats")
    best = min(ok, key=lambda r: (resident_bytes_per_token(r), r.kl))
    limit = resident_bytes_per_token(best) * (1.0 + tolerance)
    ties = [r for r in ok if r is not best and resident_bytes_per_token(r) <= limit]
    return Choice(best, ties, ok)


def _budget(row: Row):
    return parse_budget(row.budget).budget()


def registry_spec(row: Row, fixed: bool) -> str:
    """``kvbench --methods`` syntax of a row: ``snapkv@0.8125``, ``kvzip@96t``, or the bare name of a method with a
    fixed budget (``fixed``)."""
    if fixed:
        return row.method
    label = row.budget[1:] if row.budget.startswith("r") else row.budget
    return f"{row.method}@{label}"


def python_line(row: Row, fixed: bool) -> str:
    """The winner as one line of Python: a transformers cache compressing with the registered method at its budget."""
    if fixed:
        build = f"kvcore.registry.build({row.method!r})"
    else:
        b = _budget(row)
        arg = next(f"{k}={v!r}" for k in ("avg_bits", "tokens", "ratio") if (v := getattr(b, k)) is not None)
        build = f"kvcore.registry.build({row.method!r}, kvcore.Budget({arg}))"
    return f"cache = kv_hf.compressed_cache(model, {build})"
