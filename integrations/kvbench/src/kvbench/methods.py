"""Which (method, budget) pairs a kvbench run evaluates, from the methods installed packages register.

Methods come from :mod:`kvcore.registry` (entry-point group ``kvcompress.methods``); nothing here lists them. A
method is run at every ratio of the run, unless its registry entry does not take ratio budgets (the full cache):
then it is run once, at its default budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.budgets import BudgetSpec, budget_label, parse_budget
from kvcore import Budget
from kvcore.registry import Method, budget_kind

__all__ = ["GridItem", "MethodSpec", "describe", "parse_methods", "plan_grid"]


@dataclass(frozen=True)
class MethodSpec:
    """One ``--methods`` item: a registered name, optionally pinned to its own budgets (``"kivi-2@0"``)."""

    name: str
    budgets: tuple[BudgetSpec, ...] | None = None


@dataclass(frozen=True)
class GridItem:
    """One (method, budget) to evaluate; ``budget`` is ``None`` until a bytes-per-token ``target`` is matched."""

    name: str
    budget: Budget | None
    target: BudgetSpec | None = None

    @property
    def label(self) -> str:
        return budget_label(self.budget) if self.budget is not None else str(self.target)


def parse_methods(text: str) -> list[MethodSpec]:
    """``"snapkv,kivi-2@0,knorm@0.5/0.9,hqekv-2@2.5bits"`` -> method specs (``name@b1/b2`` pins its own budgets).

    Budgets use :func:`kvbench.budgets.parse_budget` syntax (ratio, ``256t``, ``2.5bits``, ``4096bpt``).

    Raises
    ------
    ValueError
        On an empty name, an empty pin or a budget that does not parse.
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
        budgets = tuple(parse_budget(b, f"--methods item {item!r}: budget") for b in pin.split("/") if b)
        if not budgets:
            raise ValueError(
                f"--methods item {item!r}: '@' must be followed by budgets, e.g. {name}@0 or {name}@0.5/0.9"
            )
        specs.append(MethodSpec(name, budgets))
    return specs


def _as_spec(b: BudgetSpec | float) -> BudgetSpec:
    return b if isinstance(b, BudgetSpec) else parse_budget(str(b))


def plan_grid(
    registry: dict[str, Method], specs: list[MethodSpec], budgets: list[BudgetSpec | float]
) -> list[GridItem]:
    """Every (name, budget) to evaluate, in order, without repeats.

    A method runs at each of its budgets (its pin, else ``budgets``) whose kind its registry entry takes; a
    bytes-per-token budget is kept as a target for :func:`kvbench.match.match_budget`. A method whose entry takes
    no budget kinds (the full cache) runs once at its default budget.

    Raises
    ------
    ValueError
        A name no installed package registers (the message lists the registered ones), a method pinned to a budget
        kind it does not take, or a method none of the run's budgets applies to.
    """
    unknown = [s.name for s in specs if s.name not in registry]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; registered: {sorted(registry)}")
    run_budgets = [_as_spec(b) for b in budgets]
    grid: list[GridItem] = []
    for spec in specs:
        method = registry[spec.name]
        wanted = run_budgets if spec.budgets is None else list(spec.budgets)
        if not method.budgets:
            refused = [b for b in wanted if b.kind == "bytes_per_token" or not method.accepts(b.budget())]
            if spec.budgets is not None and refused:
                raise ValueError(
                    f"method {spec.name!r} takes no budget (it runs at its default {method.default}); drop the '@' pin"
                )
            items = [GridItem(spec.name, method.default)]
        else:
            items = []
            for b in wanted:
                if b.kind == "bytes_per_token":
                    items.append(GridItem(spec.name, None, b))
                elif b.kind in method.budgets:
                    items.append(GridItem(spec.name, b.budget()))
                elif spec.budgets is not None:
                    raise ValueError(
                        f"method {spec.name!r} takes budgets by {sorted(method.budgets)}, not {b.kind} ({b})"
                    )
            if not items:
                raise ValueError(
                    f"method {spec.name!r} takes budgets by {sorted(method.budgets)}; none of the run's budgets "
                    f"{[str(b) for b in wanted]} is one: pin its own, e.g. {spec.name}@{_example(method)}"
                )
        for item in items:
            if item not in grid:
                grid.append(item)
    return grid


def _example(method: Method) -> str:
    return {"avg_bits": "2.5bits", "ratio": "0.5", "tokens": "256t"}[sorted(method.budgets)[0]]


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
