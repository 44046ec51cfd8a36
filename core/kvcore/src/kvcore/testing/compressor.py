"""``CompressorTests``: a ready-made method (a ``kvcore.Compressor``) end to end on one layer — the store follows
the plan and the budget, ratio 0 reads back the input, missing inputs are named, stores are independent and bytes
fall as the ratio grows.

Fixture ``compressor``. Flags: ``lossless_at_zero_ratio`` (default True), ``evicts`` (the budget's ratio evicts
entries, so per-head/per-layer counts and bytes follow it; default True). Hook ``make_extras(shapes)`` supplies
what the scorer declares in ``needs_extras``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume

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

    def samples(self, c, **kw):
        """Layers long enough for the protected window: ``T >= 8 * (sinks + recent) + 8``."""
        t = max(16, 8 * (c.protect.sinks + c.protect.recent) + 8)
        return kv_samples(min_t=t, max_t=t + 32, **kw)

    def compress(self, c, x, store=None) -> Store:
        try:
            return c.compress(self.make_context(c.scorer, x), store)
        except ValueError as e:
            assume("protected" not in str(e))  # a padded row too short for the protected window
            raise

    def test_compress_follows_plan_and_budget(self, compressor) -> None:
        def check(x):
            store, b = self.compress(compressor, x), compressor.budget
            assert isinstance(store, Store), f"compress() must return a kvcore.Store, got {type(store).__name__}"
            lens, ctx = store.seq_lengths().cpu(), self.make_context(compressor.scorer, x)
            assert torch.equal(lens, compressor.plan(ctx).keep_keys.sum(-1).cpu()), "store lengths differ from the plan"
            if self.evicts and b.avg_bits is None and b.granularity in ("head", "layer"):
                kept = torch.tensor([b.kept(int(n)) for n in ctx.valid.sum(-1)])
                if b.granularity == "head":
                    got, want = lens, kept[:, None].expand_as(lens)
                else:
                    got, want = lens.sum(-1), kept * lens.shape[1]
                assert torch.equal(got, want), f"kept {got.tolist()}, the budget says {want.tolist()}"

        forall(self.samples(compressor), check)

    def test_zero_ratio_lossless(self, compressor) -> None:
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

    def test_missing_inputs_named(self, compressor) -> None:
        s = compressor.scorer
        self.require(s.needs_queries or s.needs_extras, "scorer.needs_queries=False and scorer.needs_extras is empty")

        def check(x):
            ctx = self.make_context(s, x, queries=False, extras=False)
            missing = (["queries"] if s.needs_queries else []) + sorted(s.needs_extras)
            assert compressor.missing_inputs(ctx) == missing
            with pytest.raises(ValueError) as err:
                compressor.compress(ctx)
            assert all(name in str(err.value) for name in missing), f"the error must name {missing}: {err.value}"

        forall(self.samples(compressor), check, 5)

    def test_new_store_independent(self, compressor) -> None:
        def check(x):
            a, b = compressor.new_store(), compressor.new_store()
            assert a is not b and isinstance(a, Store) and b.nbytes() == 0
            self.compress(compressor, x, a)
            assert a.nbytes() > 0 and b.nbytes() == 0, "writing one store changed another"
            with pytest.raises(ValueError):
                b.read()

        forall(self.samples(compressor), check, 5)

    def test_bytes_fall_as_ratio_grows(self, compressor) -> None:
        self.require(self.evicts, "evicts=False")

        def check(x):
            sizes = [self.compress(compressor.with_budget(ratio=r, tokens=None), x).nbytes() for r in (0.0, 0.5, 0.75)]
            assert sizes[0] > sizes[1] > sizes[2], f"bytes at ratios 0, 0.5, 0.75: {sizes}"

        forall(self.samples(compressor, padding=False), check, 5)
