"""Which (method, budget) pairs a kvbench run evaluates, from the methods installed packages register.

Methods come from :mod:`kvcore.registry` (entry-point group ``kvcompress.methods``); nothing here lists them. A
method is run at every ratio of the run, unless its registry entry does not take ratio budgets (the full cache):
then it is run once, at its default budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcore import Budget
from kvcore.registry import Method, budget_kind

__all__ = ["MethodSpec", "describe", "parse_methods", "plan_grid"]


@dataclass(frozen=True)
class MethodSpec:
    """One ``--methods`` item: a registered name, optionally pinned to its own ratios (``"kivi-2@0"``)."""

    name: str
    ratios: tuple[float, ...] | None = None


def _ratio(text: str, item: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"--methods item {item!r}: ratio {text!r} is not a number") from None
    if not 0.0 <= value < 1.0:
        raise ValueError(f"--methods item {item!r}: ratios must be in [0, 1) (fraction removed), got {value}")
    return value


def parse_methods(text: str) -> list[MethodSpec]:
    """``"snapkv,kivi-2@0,knorm@0.5/0.9"`` -> method specs (``name@r1/r2`` pins a method to its own ratios).

    Raises
    ------
    ValueError
        On an empty name, an empty pin or a ratio outside [0, 1).
    """
    if not isinstance(text, str):
        raise TypeError(f"methods must be a str, got {type(text).__name__}")
    specs = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, pin = item.partition("@")
        if not name:
            raise ValueError(f"--methods item {item!r} has no method name")
        if not sep:
            specs.append(MethodSpec(name))
            continue
        ratios = tuple(_ratio(r, item) for r in pin.split("/") if r)
        if not ratios:
            raise ValueError(
                f"--methods item {item!r}: '@' must be followed by ratios, e.g. {name}@0 or {name}@0.5/0.9"
            )
        specs.append(MethodSpec(name, ratios))
    return specs


def plan_grid(registry: dict[str, Method], specs: list[MethodSpec], ratios: list[float]) -> list[tuple[str, Budget]]:
    """Every (name, budget) to evaluate, in order, without repeats.

    A method is built at ``Budget(ratio=r)`` for each of its ratios (its pin, else ``ratios``) when its registry
    entry takes ratio budgets; otherwise it is run once at its default budget (the full cache), whatever the
    ratios.

    Raises
    ------
    ValueError
        A name no installed package registers (the message lists the registered ones), or a method pinned to
        ratios it does not take.
    """
    unknown = [s.name for s in specs if s.name not in registry]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; registered: {sorted(registry)}")
    grid: list[tuple[str, Budget]] = []
    for spec in specs:
        method = registry[spec.name]
        budgets = [Budget(ratio=r) for r in (ratios if spec.ratios is None else spec.ratios)]
        if "ratio" not in method.budgets:
            refused = [b for b in budgets if not method.accepts(b)]
            if spec.ratios is not None and refused:
                raise ValueError(
                    f"method {spec.name!r} takes no ratio (budgets: {sorted(method.budgets) or 'its default only'}); "
                    f"drop the '@' pin"
                )
            budgets = [method.default]
        for budget in budgets:
            if (spec.name, budget) not in grid:
                grid.append((spec.name, budget))
    return grid


def describe(registry: dict[str, Method]) -> str:
    """One line per registered method: name, the budget kinds it takes (or its default budget), description."""
    rows = []
    for name in sorted(registry):
        m = registry[name]
        kinds = (
            ",".join(sorted(m.budgets))
            if m.budgets
            else f"default only ({budget_kind(m.default)} {_amount(m.default)})"
        )
        rows.append((name, kinds, m.description))
    width = [max(len(r[i]) for r in rows) for i in range(2)] if rows else [0, 0]
    return "\n".join(f"{n:<{width[0]}}  {k:<{width[1]}}  {d}" for n, k, d in rows)


def _amount(budget: Budget) -> str:
    kind = budget_kind(budget)
    return f"{getattr(budget, kind):g}"
