"""Budget specifications on the command line: ratio, tokens, average bits or bytes per token.

``0.5`` is a ratio (fraction of the cache removed, kvcore's convention), ``256t`` keeps 256 tokens per KV head,
``2.5bits`` asks for 2.5 bits per cached entry on average (HqeKV-style tiered budgets; evicted entries count 0
bits), ``4096bpt`` asks for 4,096 bytes of KV cache held per context token. The first three map to a
:class:`kvcore.Budget` directly; bytes per token is a *target* that :mod:`kvbench.match` turns into the budget,
among the ones the method's registry entry takes, whose measured held bytes come closest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvcore import Budget
from kvcore.registry import budget_kind

__all__ = ["BudgetSpec", "budget_label", "parse_budget", "parse_budgets"]

KINDS = ("ratio", "tokens", "avg_bits", "bytes_per_token")
SYNTAX = "a ratio in [0, 1) like 0.5, tokens like 256t, average bits like 2.5bits, or bytes per token like 4096bpt"


@dataclass(frozen=True)
class BudgetSpec:
    """One budget as written: ``kind`` in :data:`KINDS` and its ``value``."""

    kind: str
    value: float

    def budget(self) -> Budget:
        """The :class:`kvcore.Budget` (not for ``bytes_per_token``, which is matched per method)."""
        if self.kind == "ratio":
            return Budget(ratio=self.value)
        if self.kind == "tokens":
            return Budget(tokens=int(self.value))
        if self.kind == "avg_bits":
            return Budget(avg_bits=self.value)
        raise ValueError("a bytes-per-token budget is a target: resolve it with kvbench.match.match_budget")

    def __str__(self) -> str:
        if self.kind == "bytes_per_token":
            return f"{self.value:g}bpt"
        return budget_label(self.budget())


def budget_label(budget: Budget) -> str:
    """Short label of a budget: ``r0.5``, ``256t``, ``2.5bits``."""
    kind = budget_kind(budget)
    if kind == "avg_bits":
        return f"{budget.avg_bits:g}bits"
    if kind == "tokens":
        return f"{budget.tokens}t"
    return f"r{budget.ratio:g}"


def parse_budget(text: str, where: str = "budget") -> BudgetSpec:
    """Parse one budget (see the module docstring); ``ValueError`` naming ``where`` and the syntax otherwise."""
    if not isinstance(text, str):
        raise TypeError(f"{where} must be a str, got {type(text).__name__}")
    t = text.strip().lower()
    for suffix, kind in (("bpt", "bytes_per_token"), ("bits", "avg_bits"), ("t", "tokens"), ("r", None)):
        if kind is None and t.startswith("r"):
            t, kind = t[1:], "ratio"
            break
        if kind is not None and t.endswith(suffix):
            t = t[: -len(suffix)]
            break
    else:
        kind = "ratio"
    try:
        value = float(t)
    except ValueError:
        raise ValueError(f"{where} {text!r} is not a budget: use {SYNTAX}") from None
    if not math.isfinite(value):
        raise ValueError(f"{where} {text!r} must be finite")
    if kind == "ratio" and not 0.0 <= value < 1.0:
        raise ValueError(f"{where} {text!r}: a ratio (fraction removed) must be in [0, 1); use {SYNTAX}")
    if kind == "tokens" and (value < 1 or value != int(value)):
        raise ValueError(f"{where} {text!r}: tokens must be a whole number >= 1")
    if kind == "avg_bits" and not 0.0 < value <= 16.0:
        raise ValueError(f"{where} {text!r}: average bits must be in (0, 16]")
    if kind == "bytes_per_token" and value <= 0:
        raise ValueError(f"{where} {text!r}: bytes per token must be > 0")
    return BudgetSpec(kind, value)


def parse_budgets(text: str, where: str = "budgets", sep: str = ",") -> list[BudgetSpec]:
    """Parse a ``sep``-separated list of budgets (empty items ignored; at least one required)."""
    specs = [parse_budget(x, where) for x in text.split(sep) if x.strip()]
    if not specs:
        raise ValueError(f"{where} must name at least one budget: {SYNTAX}")
    return specs
