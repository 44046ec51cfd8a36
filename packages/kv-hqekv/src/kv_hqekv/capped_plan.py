"""A re-plan's plan that carries what capping it found to the store's next ``retier``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvcore import Plan


@dataclass(frozen=True)
class CappedPlan(Plan):
    """A re-plan's plan capped at a store's held tiers (:meth:`kv_hqekv.HqeKVStore.cap`), carrying what the
    capping found -- the entries' slots and the held tiers -- to that store's next
    :meth:`~kv_hqekv.HqeKVStore.retier`, which then need not find them again (one sort of every held entry and the
    per-entry tier maps) if nothing was edited in between. The carried state is dropped when a ``retier`` takes the
    plan (whatever the outcome); otherwise it is an ordinary :class:`kvcore.Plan`."""

    memo: list = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def of(cls, plan: Plan, memo: list) -> CappedPlan:
        """``plan`` (already validated) with ``memo``, without validating it again (host reads on a GPU)."""
        out = object.__new__(cls)
        for f in dataclasses.fields(Plan):
            object.__setattr__(out, f.name, getattr(plan, f.name))
        object.__setattr__(out, "memo", memo)
        return out
