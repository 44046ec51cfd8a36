"""Named head-to-head comparisons between two rows of one run (``--compare A:B``), paired on the same units.

The reference of every row (:mod:`kvbench.paired`) is one method at the *same budget label*, which cannot pair
methods whose budgets are of different kinds — HqeKV at 2 average bits against KIVI-2 at ratio 0, HEX-3 against
KCVT-3, SEKV at ratio 0.9 against SnapKV at the bytes SEKV holds. A comparison names both sides, each a method
with an optional ``@budget`` (needed when the method ran at several), and reports ``A − B`` per task sample
(accuracy) and per continuation window (KL), with the same seeded bootstrap as every other row, next to the bytes
each side holds in the fast tier, so "better at equal bytes" can be read (or refused) from one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.budgets import parse_budget
from kvbench.methods import GridItem
from kvbench.report import Row, format_comparisons, resident_bytes_per_token
from kvbench.stats import PairedDiff, paired_difference

__all__ = ["Comparison", "Side", "compare_rows", "format_comparisons", "parse_comparisons", "validate_comparisons"]


@dataclass(frozen=True)
class Side:
    """One side of a comparison: a method and, optionally, one of its budget labels (``r0.9``, ``2bits``)."""

    method: str
    budget: str | None = None

    def __str__(self) -> str:
        return self.method if self.budget is None else f"{self.method}@{self.budget}"


@dataclass
class Comparison:
    """``a − b`` under one protocol: bytes of each side, paired accuracy and KL differences (``None`` when a side
    has no units of that kind or the two sides were not run on the same units)."""

    a: str
    b: str
    protocol: str
    a_bytes_per_token: float
    b_bytes_per_token: float
    d_acc: PairedDiff | None = None
    d_kl: PairedDiff | None = None

    @property
    def bytes_ratio(self) -> float:
        """Fast-tier bytes of ``a`` over those of ``b`` (1.0: equal bytes)."""
        return self.a_bytes_per_token / self.b_bytes_per_token if self.b_bytes_per_token else float("inf")


def _side(text: str, where: str) -> Side:
    name, _, budget = text.strip().partition("@")
    if not name:
        raise ValueError(f"{where}: {text!r} names no method; write method or method@budget, e.g. kivi-2@0")
    if not _:
        return Side(name)
    if not budget:
        raise ValueError(f"{where}: {text!r} has an empty budget after '@'")
    return Side(name, str(parse_budget(budget, f"{where}: budget")))


def parse_comparisons(text: str | None) -> list[tuple[Side, Side]]:
    """``"hqekv-2:kivi-2@0,hex-3:kcvt-3"`` -> pairs of sides (``None`` or ``""``: no comparison).

    Raises
    ------
    ValueError
        An item that is not ``A:B``, a side naming no method, or a budget that does not parse.
    """
    if text is None or not text.strip():
        return []
    if not isinstance(text, str):
        raise TypeError(f"compare must be a str, got {type(text).__name__}")
    pairs = []
    for item in (x.strip() for x in text.split(",")):
        parts = item.split(":")
        if len(parts) != 2:
            raise ValueError(f"--compare item {item!r}: write A:B, e.g. hqekv-2:kivi-2@0 (A − B is reported)")
        a, b = (_side(p, f"--compare item {item!r}") for p in parts)
        if a == b:
            raise ValueError(f"--compare item {item!r}: both sides are {a}")
        pairs.append((a, b))
    return pairs


def validate_comparisons(pairs: list[tuple[Side, Side]], grid: list[GridItem]) -> None:
    """Check every side against the run's grid before anything is loaded.

    A side's method must run (``full`` always does); a side without a budget needs a method that runs at one
    budget; a side with a budget needs that budget among the method's. A bytes-per-token target (``snapkv@9923bpt``)
    names the budget it resolves to after loading (``--match-bytes X`` is a target of every method).

    Raises
    ------
    ValueError
        Naming the side and what the run offers.
    """
    labels: dict[str, list[str]] = {"full": ["r0"]}
    for g in grid:
        labels.setdefault(g.name, [])
        if g.label not in labels[g.name]:
            labels[g.name].append(g.label)
    for pair in pairs:
        for side in pair:
            if side.method not in labels:
                raise ValueError(f"--compare: {side.method!r} is not among the run's methods {sorted(labels)}")
            have = labels[side.method]
            if side.budget is None and len(have) > 1:
                raise ValueError(f"--compare: {side.method!r} runs at {have}; name one, e.g. {side.method}@{have[0]}")
            if side.budget is not None and side.budget not in have:
                raise ValueError(f"--compare: {side} is not run; {side.method!r} runs at {have}")


def _names(row: Row, budget: str | None) -> bool:
    if budget is None or row.budget == budget:
        return True
    target = (row.matched or {}).get("target_bytes_per_token")
    return target is not None and f"{target:g}bpt" == budget


def _pick(rows: list[Row], side: Side, protocol: str) -> Row | None:
    found = [r for r in rows if r.method == side.method and _names(r, side.budget)]
    found = [r for r in found if not r.error]
    same = [r for r in found if r.protocol == protocol]
    if same:
        return same[0]
    # the full cache's task cell is protocol-free: its single row stands for every protocol
    return found[0] if len({r.protocol for r in found}) == 1 and side.method == "full" else None


def compare_rows(
    rows: list[Row], pairs: list[tuple[Side, Side]], *, seed: int = 0, n_boot: int = 2000
) -> list[Comparison]:
    """One :class:`Comparison` per pair and protocol in which both sides ran (a refused side gives none).

    Accuracy is paired per task sample, KL per continuation window; both sides of a run are evaluated on the same
    units in the same order, so unit ``i`` of one is unit ``i`` of the other.
    """
    protocols = list(dict.fromkeys(r.protocol for r in rows if r.method != "full")) or ["agnostic"]
    out = []
    for a_side, b_side in pairs:
        for protocol in protocols:
            a, b = _pick(rows, a_side, protocol), _pick(rows, b_side, protocol)
            if a is None or b is None:
                continue
            c = Comparison(
                a=f"{a.method} {a.budget}",
                b=f"{b.method} {b.budget}",
                protocol=protocol,
                a_bytes_per_token=resident_bytes_per_token(a),
                b_bytes_per_token=resident_bytes_per_token(b),
            )
            if a.scores and len(a.scores) == len(b.scores):
                c.d_acc = paired_difference(a.scores, b.scores, seed=seed, n_boot=n_boot)
            if a.window_kl and b.window_kl and len(a.window_kl) == len(b.window_kl):
                c.d_kl = paired_difference(a.window_kl, b.window_kl, seed=seed, n_boot=n_boot)
            out.append(c)
    return out
