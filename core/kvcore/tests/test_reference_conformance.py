"""Every kvcore reference (and the toys in ``toys.py``) passes its conformance suite."""

from __future__ import annotations

import pytest
import torch
from kvcore_toys import KeyNorm, MinMax, Surprisal, ToyTieredStore, WindowAttention, surprisal_extras

from kvcore import Budget, Compressor, DenseStore, Plan, Protection, TieredSelector, TopKSelector
from kvcore.testing import CompressorTests, QuantizerTests, ScorerTests, SelectorTests, StoreTests


class TestTopKSelector(SelectorTests):
    supports_granularities = ("head", "layer", "global")

    @pytest.fixture(params=[0.0, 0.2], ids=lambda f: f"head_floor={f}")
    def selector(self, request):
        return TopKSelector(head_floor=request.param)


class TestTieredSelector(SelectorTests):
    supports_granularities = ("head", "layer")
    tiered = True

    @pytest.fixture
    def selector(self):
        return TieredSelector(tiers=(16, 4, 2, 0))


class TestTieredSelectorFixedShares(SelectorTests):
    """HqeKV's setting: 1-bit and evict shares fixed, 4/2-bit shares solved from avg_bits (Eq. 3)."""

    supports_granularities = ("head", "layer")
    supports_token_budget = False
    tiered = True
    avg_bits_choices = (1.6, 2.2, 2.8)

    @pytest.fixture
    def selector(self):
        return TieredSelector(tiers=(4, 2, 1, 0), shares={1: 0.1, 0: 0.2})


class TestDenseStore(StoreTests):
    @pytest.fixture(params=[0, 4], ids=lambda g: f"growth={g}")
    def store_factory(self, request):
        return lambda: DenseStore(growth=request.param)


class TestToyTieredStore(StoreTests):
    @pytest.fixture
    def store_factory(self):
        return ToyTieredStore


class TestMinMax(QuantizerTests):
    @pytest.fixture(params=[(b, a) for a in ("token", "channel") for b in (1, 2, 3, 4, 8)], ids=str)
    def quantizer(self, request):
        return MinMax(bits=request.param[0], axis=request.param[1], group_size=4)


class TestWindowAttention(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return WindowAttention()


class TestSurprisal(ScorerTests):
    make_extras = staticmethod(surprisal_extras)

    @pytest.fixture
    def scorer(self):
        return Surprisal()


class TestCompressor(CompressorTests):
    """``"global"``: the suite selects over the one layer through ``plan_layers`` / ``compress_layers``
    (``Compressor.plan`` alone refuses a global budget)."""

    @pytest.fixture(params=["head", "layer", "global"])
    def compressor(self, request):
        budget = Budget(0.5, granularity=request.param)
        return Compressor(KeyNorm(), TopKSelector(), DenseStore, budget, Protection(1, 2))


class ModelShapedKeyNorm(KeyNorm):
    """KeyNorm that takes one model's layers only (3 KV heads of dim 8), as a method with a trained router does."""

    def score(self, ctx):
        if ctx.keys.shape[1] != 3 or ctx.keys.shape[-1] != 8:
            raise ValueError(f"ModelShapedKeyNorm takes [B, 3, T, 8] keys, got {tuple(ctx.keys.shape)}")
        return super().score(ctx)


class TestCompressorBoundToModelShapes(CompressorTests):
    """``layer_shapes`` is honoured: every drawn layer (the short-input test's included) has the model's shapes."""

    def layer_shapes(self, c):
        return {"kv_heads": (3, 3), "head_dims": (8,), "groups": (2,)}

    @pytest.fixture
    def compressor(self):
        return Compressor(ModelShapedKeyNorm(), TopKSelector(), DenseStore, Budget(0.5), Protection(1, 2))


class TestCompressorWithQueries(CompressorTests):
    @pytest.fixture
    def compressor(self):
        return Compressor(WindowAttention(), TopKSelector(), DenseStore(), Budget(tokens=12), Protection(2, 4))


class TestCompressorWithExtras(CompressorTests):
    make_extras = staticmethod(surprisal_extras)

    @pytest.fixture
    def compressor(self):
        return Compressor(Surprisal(), TopKSelector(), DenseStore, Budget(0.75))


def test_dense_store_reads_equal_heads_without_copying_and_ragged_heads_padded():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 10, 4, generator=g), torch.randn(2, 3, 10, 4, generator=g)
    pos = torch.arange(10).expand(2, 10)
    keep = torch.rand(2, 3, 10, generator=g).argsort(-1) < 6  # 6 entries in every head
    store = DenseStore(growth=3)
    store.write(k, v, Plan.from_keep(keep), pos)
    store.append(k[:, :, :2], v[:, :, :2], pos[:, :2] + 10)  # regrows every segment to the same capacity
    view = store.read()
    assert view.keys.untyped_storage().data_ptr() == store._k.untyped_storage().data_ptr()  # zero-copy
    for b in range(2):
        for h in range(3):
            want_k = torch.cat([k[b, h][keep[b, h]], k[b, h, :2]])
            assert torch.equal(view.keys[b, h], want_k) and torch.equal(view.values[b, h][-2:], v[b, h, :2])
            assert view.positions[b, h].tolist() == pos[b][keep[b, h]].tolist() + [10, 11]
    assert bool((view.logit_bias == 0).all())
    store.crop(5)  # heads now hold different counts: padded copy with -inf bias and position -1
    ragged = store.read()
    lens = store.seq_lengths()
    assert ragged.keys.untyped_storage().data_ptr() != store._k.untyped_storage().data_ptr()
    assert torch.equal((ragged.positions >= 0).sum(-1), lens) and int(lens.min()) < int(lens.max())
    assert bool(torch.isinf(ragged.logit_bias[ragged.positions < 0]).all())
