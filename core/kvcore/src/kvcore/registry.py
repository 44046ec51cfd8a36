"""The method registry: installed packages register ready-made methods; adapters and kvbench list and build them.

A package registers a sequence of :class:`Method` objects under the entry-point group :data:`GROUP`::

    [project.entry-points."kvcompress.methods"]
    baselines = "kv_baselines.registry:METHODS"

Each ``Method`` has a name, a one-line description, the budget kinds it accepts (``"ratio"``, ``"tokens"``,
``"avg_bits"``) and a factory taking a :class:`~kvcore.budget.Budget`. Nothing is imported until
:func:`discover` runs, and a method package never imports another: a method built over another one (HubKV over
SnapKV) looks its base up here at build time (:func:`get`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from kvcore.budget import Budget

if TYPE_CHECKING:
    from kvcore.compressor import Compressor

GROUP = "kvcompress.methods"
"""Entry-point group of method tables."""

BUDGET_KINDS = ("ratio", "tokens", "avg_bits")
"""The ways a :class:`~kvcore.budget.Budget` says how much to keep."""


def budget_kind(budget: Budget) -> str:
    """Which of :data:`BUDGET_KINDS` ``budget`` uses (``avg_bits`` wins when it is set)."""
    if not isinstance(budget, Budget):
        raise TypeError(f"budget must be a kvcore.Budget, got {type(budget).__name__}")
    if budget.avg_bits is not None:
        return "avg_bits"
    return "tokens" if budget.tokens is not None else "ratio"


@dataclass(frozen=True)
class Method:
    """A ready-made method an installed package offers.

    Parameters
    ----------
    name : str
        Registry name (``"snapkv"``, ``"kivi-2"``, ``"hubkv-snapkv"``), unique over installed packages.
    factory : callable
        ``factory(budget) -> Compressor``.
    description : str
        One line for listings.
    budgets : frozenset of str
        Budget kinds the factory accepts (subset of :data:`BUDGET_KINDS`); empty for a method with a fixed
        budget (the full cache), which :meth:`build` only builds with ``default``.
    default : Budget
        The budget :meth:`build` uses when none is given.
    """

    name: str
    factory: Callable[[Budget], Compressor]
    description: str
    budgets: frozenset[str] = frozenset({"ratio", "tokens"})
    default: Budget = field(default_factory=Budget)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        if not callable(self.factory):
            raise TypeError(f"factory of method {self.name!r} must be callable, got {type(self.factory).__name__}")
        object.__setattr__(self, "budgets", frozenset(self.budgets))
        unknown = self.budgets - set(BUDGET_KINDS)
        if unknown:
            raise ValueError(
                f"budgets of method {self.name!r} must be a subset of {BUDGET_KINDS}, got {sorted(unknown)}"
            )
        if not isinstance(self.default, Budget):
            raise TypeError(f"default of method {self.name!r} must be a kvcore.Budget")

    def accepts(self, budget: Budget) -> bool:
        """Whether :meth:`build` takes ``budget`` (its kind is in ``budgets``, or it is ``default``)."""
        return budget_kind(budget) in self.budgets or budget == self.default

    def build(self, budget: Budget | None = None) -> Compressor:
        """The method's compressor at ``budget`` (``default`` if ``None``)."""
        from kvcore.compressor import Compressor

        budget = self.default if budget is None else budget
        if not self.accepts(budget):
            allowed = ", ".join(sorted(self.budgets)) or f"only its default {self.default}"
            raise ValueError(f"method {self.name!r} takes budgets by {allowed}; got {budget_kind(budget)} ({budget})")
        comp = self.factory(budget)
        if not isinstance(comp, Compressor):
            raise TypeError(f"method {self.name!r} returned {type(comp).__name__}, not a kvcore.Compressor")
        return comp

    def with_name(self, name: str) -> Method:
        return dataclasses.replace(self, name=name)


def _tables() -> Iterable[tuple[str, object]]:
    for ep in entry_points(group=GROUP):
        yield f"{ep.name} ({ep.value})", ep.load()


def collect(tables: Iterable[tuple[str, object]]) -> dict[str, Method]:
    """``{name: Method}`` from ``(source, methods)`` pairs; a name registered twice is an error."""
    found: dict[str, Method] = {}
    for source, table in tables:
        if isinstance(table, (str, bytes)) or not isinstance(table, Iterable):
            raise TypeError(f"entry point {source} must load a sequence of kvcore.registry.Method")
        for method in table:
            if not isinstance(method, Method):
                raise TypeError(f"entry point {source} holds {type(method).__name__}, not a kvcore.registry.Method")
            if method.name in found:
                raise ValueError(f"method {method.name!r} is registered twice (again by entry point {source})")
            found[method.name] = method
    return found


def discover() -> dict[str, Method]:
    """Every method registered by an installed package, by name."""
    return collect(_tables())


def get(name: str, registry: dict[str, Method] | None = None) -> Method:
    """The method registered as ``name``; ``LookupError`` listing the registered names otherwise."""
    registry = discover() if registry is None else registry
    if name not in registry:
        raise LookupError(f"no installed package registers the method {name!r}; registered: {sorted(registry)}")
    return registry[name]


def build(name: str, budget: Budget | None = None, registry: dict[str, Method] | None = None) -> Compressor:
    """``get(name).build(budget)``."""
    return get(name, registry).build(budget)
