"""``HubKV`` (Scorer wrapper), ``hubkv`` (Compressor), ``DecodingSchedule`` and the registry.

The kvcore conformance suites run on HubKV over a toy observation-window attention scorer (method
packages do not import each other, so the base is defined here).
"""

from __future__ import annotations

import math

import pytest
import torch

import kv_hubkv
from kv_hubkv import DecodingSchedule, HubKV, HubKVConfig, hubkv, refine, registry
from kvcore import Budget, Compressor, DenseStore, Protection, Scores, ScoringContext, TopKSelector
from kvcore import registry as kvregistry
from kvcore.registry import Method
from kvcore.testing import CompressorTests, ScorerTests


class WindowAttention:
    """Toy SnapKV-like base: softmax attention of the query window, mean over GQA group and window."""

    needs_queries, needs_values, needs_extras, query_window = True, False, frozenset(), None
    chunkable = False
    query_window = 8  # an adapter hint HubKV forwards

    def score(self, ctx):
        if ctx.queries is None:
            raise ValueError("WindowAttention needs ctx.queries [B, Hq, W, D]")
        _B, H, _T, D = ctx.keys.shape
        q = ctx.queries.float().unflatten(1, (H, -1))
        logits = q @ ctx.keys.float()[:, :, None].transpose(-1, -2) / math.sqrt(D)
        logits = logits.masked_fill(~ctx.valid[:, None, None, None, :], float("-inf"))
        return Scores(logits.softmax(-1).mean((2, 3)))


class KeyNorm:
    """Negative scores (-‖k‖): needs ``nonnegative='shift'``."""

    needs_queries, needs_values, needs_extras, query_window = False, True, frozenset({"unused"}), None
    chunkable = False

    def score(self, ctx):
        if "unused" not in ctx.extras:
            raise ValueError("KeyNorm toy needs extras['unused']")
        s = -ctx.keys.float().norm(dim=-1)
        return Scores(s, s * 0.5)


class Fixed:
    """Returns given scores (for exact expectations)."""

    needs_queries, needs_values, needs_extras, query_window = False, False, frozenset(), None
    chunkable = False

    def __init__(self, s):
        self.s = s

    def score(self, ctx):
        return Scores(self.s.clone())


def _ctx(B=2, H=2, T=30, D=8, G=2, W=4, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    q = torch.randn(B, H * G, W, D, generator=g)
    return ScoringContext(k, v, q, **kw)


# ----------------------------------------------------------------------------- conformance suites


class TestHubKVScorer(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return HubKV(WindowAttention(), default_ratio=0.9)


class TestHubKVShiftedNegativeBase(ScorerTests):
    def make_extras(self, shapes):
        return {"unused": torch.zeros(shapes["B"], shapes["T"])}

    @pytest.fixture
    def scorer(self):
        return HubKV(KeyNorm(), HubKVConfig(kernel_size=3), default_ratio=0.5, nonnegative="shift")


class TestHubKVCompressor(CompressorTests):
    @pytest.fixture(params=["head", "layer"])
    def compressor(self, request):
        base = Compressor(
            WindowAttention(),
            TopKSelector(),
            DenseStore,
            Budget(ratio=0.5, granularity=request.param),
            Protection(sinks=1, recent=2),
            name="window",
        )
        return hubkv(base, 0.75)


# ----------------------------------------------------------------------------- HubKV scorer


def test_hubkv_equals_refine_of_base_scores_with_protection_and_padding():
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :5] = False  # left padding in row 1
    prot = torch.zeros(2, 30, dtype=torch.bool)
    prot[:, -3:] = True
    ctx = _ctx(attention_mask=mask, protected=prot, budget=Budget(ratio=0.8))
    base = WindowAttention().score(ctx).keys
    got = HubKV(WindowAttention()).score(ctx).keys
    excluded = (prot | ~mask)[:, None, :]
    expect = refine(base, 0.8, excluded).masked_fill(~mask[:, None, :], 0.0)
    assert torch.equal(got, expect)
    assert bool((got[1, :, :5] == 0).all())
    assert float(got[:, :, -3:].min()) > float(got[:, :, :-3].max())  # protected on top


def test_hubkv_token_budget_gives_per_row_ratio():
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[0, :10] = False  # 20 real tokens in row 0 (left padding: true positions 0..19), 30 in row 1
    positions = torch.stack([(torch.arange(30) - 10).clamp_min(0), torch.arange(30)])
    ctx = _ctx(attention_mask=mask, budget=Budget(tokens=6), positions=positions)
    got = HubKV(WindowAttention()).score(ctx).keys
    base = WindowAttention().score(ctx).keys
    excl = ~mask[:, None, :]
    for b, ratio in [(0, 1 - 6 / 20), (1, 1 - 6 / 30)]:
        expect = refine(base[b], ratio, excl[b]).masked_fill(~mask[b][None], 0.0)
        assert torch.equal(got[b], expect)


def test_hubkv_needs_a_ratio_and_forwards_needs():
    s = HubKV(WindowAttention())
    assert s.needs_queries and not s.needs_values and s.needs_extras == frozenset()
    assert s.query_window == 8
    k = HubKV(KeyNorm(), nonnegative="shift")
    assert not k.needs_queries and k.needs_values and k.needs_extras == frozenset({"unused"})
    with pytest.raises(ValueError, match="ratio"):
        s.score(_ctx())
    with pytest.raises(AttributeError):
        s.no_such_attribute  # noqa: B018


def test_hubkv_negative_base_scores():
    ctx = _ctx(extras={"unused": None}, budget=Budget(ratio=0.5))
    with pytest.raises(ValueError, match=">= 0"):
        HubKV(KeyNorm()).score(ctx)
    out = HubKV(KeyNorm(), nonnegative="shift").score(ctx)
    assert out.values is not None and bool((out.keys >= 0).all())


def test_hubkv_rejects_bad_construction():
    with pytest.raises(TypeError, match="base"):
        HubKV(object())
    with pytest.raises(TypeError, match="config"):
        HubKV(WindowAttention(), config={"gamma": 0.5})
    with pytest.raises(ValueError, match="ratio"):
        HubKV(WindowAttention(), default_ratio=1.0)
    with pytest.raises(ValueError, match="nonnegative"):
        HubKV(WindowAttention(), nonnegative="clip")


def test_hubkv_rejects_wrongly_shaped_base_scores():
    ctx = _ctx(budget=Budget(ratio=0.5))
    with pytest.raises(ValueError, match="expected"):
        HubKV(Fixed(torch.rand(2, 2, 29))).score(ctx)


# ----------------------------------------------------------------------------- hubkv compressor


def test_hubkv_compressor_keeps_base_parts():
    base = Compressor(
        WindowAttention(),
        TopKSelector(head_floor=0.5),
        DenseStore,
        Budget(ratio=0.5, granularity="layer"),
        Protection(sinks=4, recent=8),
        name="window",
    )
    c = hubkv(base, 0.9)
    assert isinstance(c.scorer, HubKV) and c.scorer.base is base.scorer
    assert c.selector is base.selector and c.store is base.store and c.protect is base.protect
    assert c.budget == Budget(ratio=0.9, granularity="layer") and c.name == "hubkv+window"
    assert hubkv(base).budget == base.budget
    with pytest.raises(TypeError, match="Compressor"):
        hubkv(WindowAttention(), 0.5)


def test_hubkv_spreads_the_budget_over_clusters_where_topk_does_not():
    # Paper §2.3/§3.3 on a synthetic clustered trace: 6 clusters of 7 tokens (peak 1 or 0.8, flanks
    # 0.95/0.9/0.85 of the peak). Keeping 6 tokens per head, base Top-K spends them in the two
    # highest clusters; HubKV (λ = 0.81, γ = 0.5) discounts flanks to <= 0.6x and keeps each peak.
    T, width = 60, 10
    row = torch.zeros(T)
    peaks = [1.0, 0.8, 0.8, 1.0, 0.8, 0.8]
    for c, h in enumerate(peaks):
        centre = c * width + 5
        for d, f in zip(range(-3, 4), [0.85, 0.9, 0.95, 1.0, 0.95, 0.9, 0.85]):
            row[centre + d] = h * f
    s = row.expand(1, 2, T).contiguous()
    ctx = _ctx(B=1, T=T)
    budget = Budget(tokens=6)

    def clusters(scorer):
        c = Compressor(scorer, TopKSelector(), DenseStore, budget)
        kept = c.plan(ctx).keep_keys[0, 0].nonzero().flatten()
        return {int(i) // width for i in kept}

    assert len(clusters(Fixed(s))) == 2
    assert clusters(HubKV(Fixed(s))) == set(range(6))


# ----------------------------------------------------------------------------- decoding schedule


def test_decoding_schedule():
    sch = DecodingSchedule(target_length=1024)
    assert sch.interval == 128
    assert [g for g in range(0, 600) if sch.due(g)] == [128, 256, 384, 512]
    assert sch.needs_compression(1025) and not sch.needs_compression(1024)
    assert sch.ratio(4096) == 1 - 1024 / 4096 and sch.ratio(512) == 0.0
    assert sch.budget() == Budget(tokens=1024)
    assert sch.cache_options() == {"recompress_every": 128, "target_length": 1024}
    # the gate ratio HubKV derives from the schedule's token budget is the schedule's ratio at prefill
    ctx = _ctx(B=1, T=40, budget=DecodingSchedule(target_length=10).budget())
    assert HubKV(WindowAttention())._ratios(ctx) == [DecodingSchedule(target_length=10).ratio(40)]
    # while decoding, the cache holds target + interval entries of a longer sequence: the gate uses the true
    # compression over every token seen (1 - 10 / 400), not over the 40 held entries (1 - 10 / 40)
    kept = torch.cat([torch.arange(10) * 30, torch.arange(370, 400)])[None]  # 10 survivors + the last 30 tokens
    ctx = _ctx(B=1, T=40, budget=DecodingSchedule(target_length=10).budget(), positions=kept)
    assert HubKV(WindowAttention())._ratios(ctx) == [DecodingSchedule(target_length=10).ratio(400)]
    for bad, err in [(dict(target_length=0), ValueError), (dict(target_length=8, interval=0), ValueError)]:
        with pytest.raises(err, match=next(reversed(bad))):
            DecodingSchedule(**bad)
    with pytest.raises(TypeError, match="target_length must be an int"):
        DecodingSchedule(target_length=2.5)
    with pytest.raises(ValueError, match="granularity"):
        DecodingSchedule(target_length=8, granularity="token")
    with pytest.raises(TypeError):
        DecodingSchedule(128)  # keyword-only


# ----------------------------------------------------------------------------- registry


def test_registry_entries_and_lookup_errors():
    names = [m.name for m in registry.METHODS]
    assert names == ["hubkv", "hubkv-snapkv", "hubkv-h2o", "hubkv-kvzip", "hubkv-fastkvzip"]
    assert all(isinstance(m, Method) and m.budgets == {"ratio", "tokens"} for m in registry.METHODS)
    missing = registry.over("no_such_method")
    assert missing.name == "hubkv-no_such_method"
    with pytest.raises(LookupError, match=r"HubKV over 'no_such_method': .*registered: \[") as info:
        missing.build(Budget(ratio=0.5))
    for name in kvregistry.discover():
        assert repr(name) in str(info.value)
    with pytest.raises(ValueError, match="base must be"):
        registry.over("")


def test_registry_wraps_the_registered_base_when_installed():
    installed = kvregistry.discover()
    if "snapkv" not in installed:
        pytest.skip("no installed package registers 'snapkv' (kv-baselines not installed)")
    for budget in [Budget(ratio=0.9), Budget(tokens=48)]:
        c = kvregistry.build("hubkv-snapkv", budget)
        base = installed["snapkv"].build(budget)
        assert isinstance(c.scorer, HubKV) and type(c.scorer.base) is type(base.scorer)
        assert c.budget == base.budget and c.protect == base.protect and c.selector == base.selector
    with pytest.raises(ValueError, match="takes budgets by ratio, tokens"):
        kvregistry.build("hubkv-snapkv", Budget(avg_bits=3.0))


def test_package_exports():
    for name in kv_hubkv.__all__:
        assert hasattr(kv_hubkv, name)
