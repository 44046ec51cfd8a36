"""``CompressorTests``: a ready-made method (a ``kvcore.Compressor``) end to end on one layer — the store follows
the plan and the budget, ratio 0 reads back the input, missing inputs are named, stores are independent and bytes
fall as the ratio grows.

Fixture ``compressor``. Flags: ``lossless_at_zero_ratio`` (default True), ``evicts`` (the budget's ratio evicts
entries, so per-head/per-layer counts and bytes follow it; default True). Hook ``make_extras(shapes)`` supplies
what the scorer declares in ``needs_extras``; ``layer_shapes(c)`` fixes the drawn layers' shapes (``Hkv``, ``D``, GQA
group) for a method bound to a model's. A compressor whose budget has ``granularity="global"`` (a selection
over every layer at once, KVzip's) is run through ``plan_layers`` / ``compress_layers`` on the one drawn layer, where
it keeps what a ``"layer"`` budget keeps; override :meth:`CompressorTests.plan` and :meth:`CompressorTests.write` to
drive a compressor another way.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

from kvcore.compressor import Compressor, ShortInputWarning
from kvcore.context import ScoringContext
from kvcore.plan import Plan
from kvcore.protocols import Store
from kvcore.testing.base import ContextTests, forall
from kvcore.testing.strategies import kv_samples


class CompressorTests(ContextTests):
    """Standard tests for a ``kvcore.Compressor``."""

    lossless_at_zero_ratio: bool = True
    evicts: bool = True

    @pytest.fixture
    def compressor(self):
        raise NotImplementedError("override the `compressor` fixture: return the Compressor under test")

    def layer_shapes(self, c: Compressor) -> dict[str, Any]:
        """Keyword arguments of :func:`~kvcore.testing.strategies.kv_samples` that every drawn layer uses (default
        none: any ``Hkv``, ``D`` and GQA group). Override for a method bound to a model's shapes, e.g. a trained
        router: ``{"kv_heads": (3, 3), "head_dims": (64,), "groups": (3,)}``, or needing longer layers than the
        protected window asks for (``min_t`` / ``max_t``; the short-input test keeps its own lengths).

        Parameters
        ----------
        c : kvcore.Compressor
            The compressor under test.

        Returns
        -------
        dict
            ``kv_heads``, ``head_dims``, ``groups`` ... as :func:`~kvcore.testing.strategies.kv_samples` takes them.
        """
        return {}

    def samples(self, c, **kw):
        """Layers long enough for the protected window: ``T >= 8 * (sinks + recent) + 8``, of :meth:`layer_shapes`."""
        t = max(16, 8 * (c.protect.sinks + c.protect.recent) + 8)
        return kv_samples(**{"min_t": t, "max_t": t + 32, **self.layer_shapes(c), **kw})

    def plan(self, c: Compressor, ctx: ScoringContext) -> Plan:
        """The plan of one layer: ``c.plan(ctx)``, or ``c.plan_layers([ctx])[0]`` under a ``"global"`` budget.

        Parameters
        ----------
        c : kvcore.Compressor
            The compressor under test (or one derived from it: another budget, ``strict=True``).
        ctx : kvcore.ScoringContext
            One layer's context.

        Returns
        -------
        kvcore.Plan
            The selector's plan of that layer.
        """
        return c.plan_layers([ctx])[0] if c.budget.granularity == "global" else c.plan(ctx)

    def write(self, c: Compressor, ctx: ScoringContext, store: Store | None = None) -> Store:
        """Compress one layer: ``c.compress(ctx, store)``, or ``c.compress_layers([ctx], [store])[0]`` under a
        ``"global"`` budget.

        Parameters
        ----------
        c : kvcore.Compressor
            The compressor under test (or one derived from it).
        ctx : kvcore.ScoringContext
            One layer's context.
        store : kvcore.Store, optional
            The store to write into; ``None``: ``c.new_store()``.

        Returns
        -------
        kvcore.Store
            The store holding the compressed layer.
        """
        if c.budget.granularity != "global":
            return c.compress(ctx, store)
        return c.compress_layers([ctx], None if store is None else [store])[0]

    def compress(self, c, x, store=None) -> Store:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ShortInputWarning)  # a padded row too short for the protected window
            return self.write(c, self.make_context(c.scorer, x), store)

    def test_compress_follows_plan_and_budget(self, compressor) -> None:
        """``compress`` returns a Store holding exactly what ``plan`` keeps, and (for eviction budgets at ``head`` /
        ``layer`` granularity) as many entries per head / per layer as the budget says (rows too short for the budget
        keep their protected entries).

        Troubleshooting: a count off by one usually means ``ratio`` was read as the fraction kept (it is the fraction
        removed) or rounded instead of floored (``Budget.kept``); lengths that differ from the plan mean the store
        drops or duplicates entries in ``write``. Set ``evicts = False`` for a method whose budget does not evict."""

        def check(x):
            store, b = self.compress(compressor, x), compressor.budget
            assert isinstance(store, Store), f"compress() must return a kvcore.Store, got {type(store).__name__}"
            lens, ctx = store.seq_lengths().cpu(), self.make_context(compressor.scorer, x)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ShortInputWarning)
                plan = self.plan(compressor, ctx)
            assert torch.equal(lens, plan.keep_keys.sum(-1).cpu()), "store lengths differ from the plan"
            if self.evicts and b.avg_bits is None and b.granularity in ("head", "layer", "global"):
                prot = compressor.protect.mask(ctx.valid).sum(-1)  # rows too short for the budget keep the protected
                kept = torch.tensor([max(b.kept(int(n)), int(p)) for n, p in zip(ctx.valid.sum(-1), prot)])
                if b.granularity == "head":
                    got, want = lens, kept[:, None].expand_as(lens)
                else:
                    got, want = lens.sum(-1), kept * lens.shape[1]
                assert torch.equal(got, want), f"kept {got.tolist()}, the budget says {want.tolist()}"

        forall(self.samples(compressor), check)

    def test_zero_ratio_lossless(self, compressor) -> None:
        """At ratio 0 every real entry reads back bit-exact with its true position.

        Troubleshooting: the store quantizes or casts the full-precision tier, the selector drops entries at ratio 0,
        or positions are derived from the cache length instead of ``ctx.positions``. A quantizing method sets
        ``lossless_at_zero_ratio = False``."""
        self.require(self.lossless_at_zero_ratio, "lossless_at_zero_ratio=False")
        c = compressor.with_budget(ratio=0.0, tokens=None, avg_bits=None)

        def check(x):
            view, ctx = self.compress(c, x).read(), self.make_context(c.scorer, x)
            for b in range(x.keys.shape[0]):
                for h, m, r in ((h, view.positions[b, h] >= 0, ctx.valid[b]) for h in range(x.keys.shape[1])):
                    assert torch.equal(view.positions[b, h][m], ctx.positions[b][r].long()), "positions changed"
                    assert torch.equal(view.keys[b, h][m], x.keys[b, h][r]), "keys changed at ratio 0"
                    assert torch.equal(view.values[b, h][m], x.values[b, h][r]), "values changed at ratio 0"

        forall(self.samples(c), check, 8)

    def test_rejects_non_finite_inputs(self, compressor) -> None:
        """NaN or ±inf in the keys, values or queries of a layer raise ``ValueError`` naming the tensor before anything
        is scored or stored (with ``Compressor.validate``, the default); the given store is left untouched.

        Troubleshooting: build the ready-made compressor as a ``kvcore.Compressor`` (its ``score`` runs the check)
        and do not pass ``validate=False`` by default; a scorer that catches NaN itself must still raise
        ``ValueError``, never return finite garbage."""
        self.require(compressor.validate, "compressor.validate=False")

        def check(args):
            x, bad = args
            ctx = self.make_context(compressor.scorer, x)
            for name in ("keys", "values", "queries"):
                t = getattr(ctx, name)
                if t is None:
                    continue
                t = t.clone()
                t.view(-1)[t.numel() // 2] = bad
                store = compressor.new_store()
                with pytest.raises(ValueError, match=name):
                    self.write(compressor, dataclasses.replace(ctx, **{name: t}), store)
                assert int(store.seq_lengths().sum()) == 0, "a rejected layer must leave the store empty"

        cases = st.tuples(self.samples(compressor), st.sampled_from((float("nan"), float("inf"), float("-inf"))))
        forall(cases, check, 6)

    def test_missing_inputs_named(self, compressor) -> None:
        """A context without the queries / extras the scorer declares is refused by ``compress`` with a
        ``ValueError`` naming each missing input, and ``missing_inputs`` lists them.

        Troubleshooting: declare what the scorer reads (``needs_queries = True``, ``needs_extras = frozenset({...})``)
        as class attributes; the Compressor names missing inputs from those declarations."""
        s = compressor.scorer
        self.require(s.needs_queries or s.needs_extras, "scorer.needs_queries=False and scorer.needs_extras is empty")

        def check(x):
            ctx = self.make_context(s, x, queries=False, extras=False)
            missing = (["queries"] if s.needs_queries else []) + sorted(s.needs_extras)
            assert compressor.missing_inputs(ctx) == missing
            with pytest.raises(ValueError) as err:
                self.write(compressor, ctx)
            assert all(name in str(err.value) for name in missing), f"the error must name {missing}: {err.value}"

        forall(self.samples(compressor), check, 5)

    def test_new_store_independent(self, compressor) -> None:
        """``new_store()`` returns a fresh empty Store each call; writing one does not touch another.

        Troubleshooting: pass the Compressor a store factory (a class or ``lambda: MyStore(...)``) or an empty
        prototype; a prototype holding shared tensors (class-level buffers) leaks content between layers."""

        def check(x):
            a, b = compressor.new_store(), compressor.new_store()
            assert a is not b and isinstance(a, Store) and b.nbytes() == 0
            self.compress(compressor, x, a)
            assert a.nbytes() > 0 and b.nbytes() == 0, "writing one store changed another"
            with pytest.raises(ValueError):
                b.read()

        forall(self.samples(compressor), check, 5)

    def test_bytes_fall_as_ratio_grows(self, compressor) -> None:
        """``nbytes()`` of the compressed layer strictly falls as the ratio grows (0, 0.5, 0.75).

        Troubleshooting: the store keeps the evicted entries' memory (a mask over the full buffer instead of
        gathering the kept entries), or the budget is not passed to the selector. Set ``evicts = False`` for methods
        whose budget does not evict."""
        self.require(self.evicts, "evicts=False")

        def check(x):
            sizes = [self.compress(compressor.with_budget(ratio=r, tokens=None), x).nbytes() for r in (0.0, 0.5, 0.75)]
            assert sizes[0] > sizes[1] > sizes[2], f"bytes at ratios 0, 0.5, 0.75: {sizes}"

        forall(self.samples(compressor, padding=False), check, 5)

    def test_short_input_policy(self, compressor) -> None:
        """An input shorter than the protected window: ``strict=False`` keeps every protected entry and warns
        (``ShortInputWarning``); ``strict=True`` raises ``ValueError``.

        Troubleshooting: a failure means the ready-made compressor does not pass its budget through
        ``Compressor.plan`` / ``Compressor.select``, or its selector ignores a token budget."""
        self.require(self.evicts and compressor.budget.avg_bits is None, "evicts=False or an avg_bits budget")
        n_prot = compressor.protect.sinks + compressor.protect.recent
        c = compressor.with_budget(ratio=0.9, tokens=None)
        self.require(n_prot >= 2, "the compressor protects fewer than 2 tokens")

        def check(x):
            ctx = self.make_context(c.scorer, x)
            if not c.short_rows(c.protect.mask(ctx.valid), ctx.valid):
                return
            with pytest.warns(ShortInputWarning):
                plan = self.plan(c, ctx)
            prot = c.protect.mask(ctx.valid)[:, None, :].expand(plan.key_bits.shape)
            assert bool(plan.keep_keys[prot].all()), "a protected entry was evicted"
            with pytest.raises(ValueError):
                self.plan(dataclasses.replace(c, strict=True), ctx)

        forall(kv_samples(**{**self.layer_shapes(c), "min_t": 2, "max_t": max(2, n_prot)}), check, 8)
