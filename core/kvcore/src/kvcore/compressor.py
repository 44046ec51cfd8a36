"""The composition object adapters take: scorer -> selector -> store (DESIGN.md §2-3)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvcore.budget import Budget
from kvcore.context import ScoringContext
from kvcore.plan import Plan
from kvcore.protection import Protection
from kvcore.protocols import Scorer, Selector, Store
from kvcore.scores import Scores


@dataclass
class Compressor:
    """A compression method built from protocol objects; swap any part.

    Parameters
    ----------
    scorer : Scorer
        Importance of every entry.
    selector : Selector
        Turns scores into a plan under ``budget``.
    store : Store or callable
        A per-layer factory (a Store class or ``lambda: DenseStore(growth=16)``) or an empty prototype that is
        deep-copied per layer.
    budget : Budget
        How much to keep (``ratio`` = fraction removed).
    protect : Protection
        Sinks / recent window always kept, counted inside the budget.
    name : str
        Display name (``"snapkv"``).
    """

    scorer: Scorer
    selector: Selector
    store: Store | Callable[[], Store]
    budget: Budget = field(default_factory=Budget)
    protect: Protection = field(default_factory=Protection)
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.scorer, Scorer):
            raise TypeError(f"scorer must implement kvcore.Scorer, got {type(self.scorer).__name__}")
        if not isinstance(self.selector, Selector):
            raise TypeError(f"selector must implement kvcore.Selector, got {type(self.selector).__name__}")
        if not (isinstance(self.store, Store) or callable(self.store)):
            raise TypeError(f"store must be a kvcore.Store or a factory returning one, got {type(self.store).__name__}")
        if not isinstance(self.budget, Budget):
            raise TypeError(f"budget must be a kvcore.Budget, got {type(self.budget).__name__}")
        if not isinstance(self.protect, Protection):
            raise TypeError(f"protect must be a kvcore.Protection, got {type(self.protect).__name__}")

    def with_budget(self, **changes) -> "Compressor":
        """A copy with budget fields replaced, e.g. ``c.with_budget(ratio=0.75)``."""
        return dataclasses.replace(self, budget=dataclasses.replace(self.budget, **changes))

    def new_store(self) -> Store:
        """A fresh, empty store for one layer."""
        is_prototype = isinstance(self.store, Store) and not isinstance(self.store, type)
        store = copy.deepcopy(self.store) if is_prototype else self.store()
        if not isinstance(store, Store):
            raise TypeError(f"the store factory returned {type(store).__name__}, not a kvcore.Store")
        return store

    def missing_inputs(self, ctx: ScoringContext) -> list[str]:
        """Inputs the scorer declared that ``ctx`` lacks (empty when it can run)."""
        missing = ["queries"] if self.scorer.needs_queries and ctx.queries is None else []
        return missing + sorted(k for k in self.scorer.needs_extras if k not in ctx.extras)

    def score(self, ctx: ScoringContext) -> tuple[Scores, torch.Tensor]:
        """Scores of ``ctx`` and the protected mask ``[B, T]`` used for them."""
        missing = self.missing_inputs(ctx)
        if missing:
            raise ValueError(f"scorer {type(self.scorer).__name__} needs {missing}, which the context does not provide")
        protected = self.protect.mask(ctx.valid)
        if ctx.protected is not None:
            protected = protected | ctx.protected
        ctx = dataclasses.replace(ctx, budget=self.budget, protected=protected)
        scores = self.scorer.score(ctx)
        expect = (ctx.batch_size, ctx.num_kv_heads, ctx.seq_len)
        if not isinstance(scores, Scores) or tuple(scores.keys.shape) != expect:
            raise ValueError(f"scorer {type(self.scorer).__name__} must return Scores of shape {expect}")
        return scores, protected

    def plan(self, ctx: ScoringContext) -> Plan:
        """Score and select one layer."""
        scores, protected = self.score(ctx)
        return self.selector.select(scores, self.budget, protected, ctx.valid)

    def compress(self, ctx: ScoringContext, store: Store | None = None) -> Store:
        """Score, select and write one layer into ``store`` (a new one if ``None``); returns the store."""
        store = self.new_store() if store is None else store
        store.write(ctx.keys, ctx.values, self.plan(ctx), ctx.positions)
        return store

    def compress_layers(self, ctxs: Sequence[ScoringContext]) -> list[Store]:
        """Compress all layers; under ``"global"`` granularity the selection spans every layer at once."""
        if self.budget.granularity != "global":
            return [self.compress(c) for c in ctxs]
        scored = [self.score(c) for c in ctxs]
        keys = torch.stack([s.keys for s, _ in scored])
        values = None if all(s.values is None for s, _ in scored) else torch.stack([s.for_values for s, _ in scored])
        plan = self.selector.select(Scores(keys, values), self.budget, scored[0][1], ctxs[0].valid)
        stores = []
        for i, c in enumerate(ctxs):
            vb = None if plan.value_bits is None else plan.value_bits[i]
            store = self.new_store()
            store.write(c.keys, c.values, Plan(plan.key_bits[i], vb), c.positions)
            stores.append(store)
        return stores
