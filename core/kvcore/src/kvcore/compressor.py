"""The composition object adapters take: scorer -> selector -> store (docs/architecture.md)."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvcore.attending import attends
from kvcore.budget import Budget
from kvcore.checks import check_int
from kvcore.context import ScoringContext
from kvcore.plan import EVICT, FULL, TIERS, Plan
from kvcore.protection import Protection
from kvcore.protocols import PlanBits, Scorer, Selector, Store, TierPolicy
from kvcore.scores import Scores
from kvcore.tier_shares import tier_shares


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
        deep-copied per layer. Paired with the selector by the tier rule below.
    budget : Budget
        How much to keep (``ratio`` = fraction removed).
    protect : Protection
        Sinks / recent window always kept, counted inside the budget.
    name : str
        Display name (``"snapkv"``).
    strict : bool
        What to do with an input too short for the budget, where the budget would keep fewer entries than are
        protected (a 100-token prompt under a 64-token observation window at ratio 0.5). ``False`` (default):
        keep the protected entries — the least that honours the protection — and warn once (``ShortInputWarning``);
        ``True``: raise ``ValueError`` as the selector does.
    validate : bool
        Reject NaN / ±inf keys, values and queries with a ``ValueError`` naming the tensor and the layer (one
        reduction per tensor and a host sync). ``False`` skips the check, for trusted hot paths.
    replan_every : int, optional
        The method re-plans its own held entries every ``N`` decoded tokens, under this compressor's own budget
        (HqeKV re-tiers every ``T = 32`` tokens, §3.5). Adapters honour it without a re-compression target;
        ``None`` (default): the method does nothing while decoding unless the adapter is told to re-compress.
    replanner : callable, optional
        ``replanner(store, compressor, *, queries, extras, layer_idx, protect_before) -> Plan``: how
        :func:`kvcore.replan` re-plans this compressor's held entries (a method that scores from state its
        store keeps, such as HqeKV's window); it may hand back to :func:`kvcore.replan_view`. ``None``
        (default): :func:`kvcore.replan_view`, which scores the store's ``read()`` view.

    Notes
    -----
    The tier rule (docs/protocols.md, "Composition"). A store that quantizes (``supported_bits`` holds a width in
    1-8) quantizes only the entries a plan tiers at its widths. When the selector declares its tiers
    (:class:`kvcore.PlanBits`), construction builds one store and checks the pair:

    * the selector plans a quantized width the store does not hold: ``ValueError``;
    * the selector only keeps or evicts (``plan_bits`` has no width in 1-8) and the store quantizes: if the store
      has a tier policy of its own (:class:`kvcore.TierPolicy`, e.g. KIVI's prefill layout), :meth:`compress` and
      :meth:`compress_layers` write ``store.apply_tiers(plan)`` (see :meth:`plan_for`), so the store quantizes what
      the selector keeps; otherwise ``ValueError`` — never a quantizing store silently holding a full-precision
      cache.

    :meth:`plan` and :meth:`plan_layers` return the selector's own plans (what re-planning with
    :func:`kvcore.replan` needs: a re-plan only keeps or evicts held entries of a store that cannot demote).
    """

    scorer: Scorer
    selector: Selector
    store: Store | Callable[[], Store]
    budget: Budget = field(default_factory=Budget)
    protect: Protection = field(default_factory=Protection)
    name: str = ""
    strict: bool = False
    validate: bool = True
    replan_every: int | None = None
    replanner: Callable[..., Plan] | None = None

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
        for flag in ("strict", "validate"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {type(getattr(self, flag)).__name__}")
        check_int("replan_every", self.replan_every, low=1, optional="no re-planning while decoding")
        if self.replanner is not None and not callable(self.replanner):
            raise TypeError(f"replanner must be callable or None, got {type(self.replanner).__name__}")
        tier_shares(self.selector)  # a declared capability without its method is refused now, not at first use
        if isinstance(self.store, Store) and not isinstance(self.store, type):
            attends(self.store)
        if isinstance(self.selector, PlanBits):
            bits = self.selector.plan_bits
            if not isinstance(bits, frozenset) or not bits or not all(type(b) is int and b in TIERS for b in bits):
                raise TypeError(
                    f"selector {type(self.selector).__name__} declares plan_bits={bits!r}; it must be a non-empty "
                    "frozenset of tiers in {0 (evict), 1-8, 16 (full)}"
                )
            self._store_tiers(self.new_store())  # the tier rule, checked now rather than at the first compress

    def _store_tiers(self, store: Store) -> bool:
        """Whether ``store`` tiers the selector's plans itself (``apply_tiers``); raises where the pair cannot work
        (the class notes' tier rule)."""
        if not isinstance(self.selector, PlanBits):
            return False
        sel, held = type(self.selector).__name__, type(store).__name__
        planned = self.selector.plan_bits - {EVICT, FULL}
        quantized = frozenset(store.supported_bits) - {EVICT, FULL}
        if planned - quantized:
            raise ValueError(
                f"selector {sel} plans tiers {sorted(planned - quantized)} that store {held} cannot hold "
                f"(supported_bits {sorted(store.supported_bits)})"
            )
        if planned or not quantized:
            return False
        if isinstance(store, TierPolicy):
            return True
        raise ValueError(
            f"store {held} quantizes only what a plan tiers at {sorted(quantized)} bits, but selector {sel} only "
            f"keeps or evicts (plan_bits {sorted(self.selector.plan_bits)}), so it would hold everything at full "
            "precision: pass a selector that tiers what it keeps (e.g. kvcore.TieredSelector), a full-precision "
            "store, or a store with a tier policy of its own (kvcore.TierPolicy)"
        )

    def plan_for(self, store: Store, plan: Plan) -> Plan:
        """The plan ``store.write`` receives for ``plan`` (the selector's): ``store.apply_tiers(plan)`` when the
        selector only keeps or evicts and ``store`` quantizes by its own :class:`kvcore.TierPolicy`, else ``plan``
        (the class notes' tier rule). Adapters that write a plan themselves call it too."""
        if not self._store_tiers(store):
            return plan
        tiered = store.apply_tiers(plan)
        if not isinstance(tiered, Plan):
            name, got = type(store).__name__, type(tiered).__name__
            raise TypeError(f"{name}.apply_tiers must return a kvcore.Plan, got {got}")
        return tiered

    def with_budget(self, **changes) -> Compressor:
        """A copy with budget fields replaced, e.g. ``c.with_budget(ratio=0.75)``."""
        return dataclasses.replace(self, budget=dataclasses.replace(self.budget, **changes))

    def new_store(self) -> Store:
        """A fresh, empty store for one layer."""
        is_prototype = isinstance(self.store, Store) and not isinstance(self.store, type)
        store = copy.deepcopy(self.store) if is_prototype else self.store()
        if not isinstance(store, Store):
            raise TypeError(f"the store factory returned {type(store).__name__}, not a kvcore.Store")
        attends(store)  # TypeError: can_attend = True without attend()
        return store

    def missing_inputs(self, ctx: ScoringContext) -> list[str]:
        """Inputs the scorer declared that ``ctx`` lacks (empty when it can run)."""
        missing = ["queries"] if self.scorer.needs_queries and ctx.queries is None else []
        return missing + sorted(k for k in self.scorer.needs_extras if k not in ctx.extras)

    def score(self, ctx: ScoringContext) -> tuple[Scores, torch.Tensor]:
        """Scores of ``ctx`` and the protected mask ``[B, T]`` used for them."""
        if not isinstance(ctx, ScoringContext):
            raise TypeError(f"ctx must be a kvcore.ScoringContext, got {type(ctx).__name__}")
        if self.validate:
            for name in ("keys", "values", "queries"):
                t = getattr(ctx, name)
                if t is not None and t.numel() and not bool(torch.isfinite(t).all()):
                    raise ValueError(
                        f"{name} of layer {ctx.layer_idx} hold NaN or inf; kvcompress refuses to score or store them "
                        "(Compressor(validate=False) skips this check)"
                    )
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
        return self.select(scores, protected, ctx.valid)

    def short_rows(self, protected: torch.Tensor, valid: torch.Tensor) -> list[int]:
        """Batch rows whose budget keeps fewer entries per head than they protect (inputs too short for it)."""
        if self.budget.avg_bits is not None:
            return []
        n_valid = valid.sum(-1).tolist()
        n_prot = (protected & valid).sum(-1).tolist()
        return [b for b, (n, p) in enumerate(zip(n_valid, n_prot)) if self.budget.kept(int(n)) < p]

    def select(self, scores: Scores, protected: torch.Tensor, valid: torch.Tensor) -> Plan:
        """The selector's plan under the budget, with the short-input policy (see ``strict``).

        Rows too short for the budget keep exactly their protected entries (a token budget of that count, selected
        row by row; the other rows keep their budget) and a ``ShortInputWarning`` is issued; ``strict=True``
        lets the selector raise instead.
        """
        short = [] if self.strict else self.short_rows(protected, valid)
        if not short:
            return self.selector.select(scores, self.budget, protected, valid)
        warnings.warn(
            f"{self.name or 'compressor'}: batch rows {short} are too short for the budget {self.budget} (fewer "
            "entries kept than protected); keeping their protected entries (Compressor(strict=True) raises instead)",
            ShortInputWarning,
            stacklevel=3,
        )
        dim = scores.keys.ndim - 3  # batch dim of [B, H, T] or [L, B, H, T]
        n_prot = (protected & valid).sum(-1).tolist()
        plans = []
        for b in range(valid.shape[0]):
            row = slice(b, b + 1)
            budget = (
                dataclasses.replace(self.budget, ratio=None, tokens=max(1, n_prot[b])) if b in short else self.budget
            )
            part = Scores(*(None if t is None else t.narrow(dim, b, 1) for t in (scores.keys, scores.values)))
            plans.append(self.selector.select(part, budget, protected[row], valid[row]))
        return Plan(
            torch.cat([p.key_bits for p in plans], dim),
            None if all(p.value_bits is None for p in plans) else torch.cat([p.bits_for_values for p in plans], dim),
            None if all(p.full_precision is None for p in plans) else torch.cat([_fp(p) for p in plans], dim),
        )

    def compress(self, ctx: ScoringContext, store: Store | None = None) -> Store:
        """Score, select and write one layer into ``store`` (a new one if ``None``); returns the store. The plan
        written is :meth:`plan_for` of the selector's (the tier rule of the class notes)."""
        plan = self.plan(ctx)
        store = self.new_store() if store is None else store
        store.write(ctx.keys, ctx.values, self.plan_for(store, plan), ctx.positions)
        return store

    def plan_layers(self, ctxs: Sequence[ScoringContext]) -> list[Plan]:
        """Plans of all layers; under ``"global"`` granularity the selection spans every layer at once."""
        if self.budget.granularity != "global":
            return [self.plan(c) for c in ctxs]
        if not ctxs:
            return []
        if len({(c.batch_size, c.num_kv_heads, c.seq_len) for c in ctxs}) != 1:
            raise ValueError("a 'global' budget needs every layer's context to have the same [B, Hkv, T]")
        scored = [self.score(c) for c in ctxs]
        keys = torch.stack([s.keys for s, _ in scored])
        values = None if all(s.values is None for s, _ in scored) else torch.stack([s.for_values for s, _ in scored])
        plan = self.select(Scores(keys, values), scored[0][1], ctxs[0].valid)
        return [
            Plan(plan.key_bits[i], None if plan.value_bits is None else plan.value_bits[i]) for i in range(len(ctxs))
        ]

    def compress_layers(self, ctxs: Sequence[ScoringContext], stores: Sequence[Store] | None = None) -> list[Store]:
        """Score, select and write all layers (into ``stores``, or new ones); under ``"global"`` granularity the
        selection spans every layer at once. Returns the stores."""
        if stores is not None and len(stores) != len(ctxs):
            raise ValueError(f"got {len(stores)} stores for {len(ctxs)} layer contexts")
        plans = self.plan_layers(ctxs)
        out = list(stores) if stores is not None else [self.new_store() for _ in ctxs]
        for store, c, plan in zip(out, ctxs, plans):
            store.write(c.keys, c.values, self.plan_for(store, plan), c.positions)
        return out


class ShortInputWarning(UserWarning):
    """An input was too short for a compressor's budget; the protected entries were kept (``strict=False``)."""


def _fp(plan: Plan) -> torch.Tensor:
    if plan.full_precision is not None:
        return plan.full_precision
    raise ValueError("the selector returned element-level full-precision masks for some batch rows only")
