"""Table 5 ablations (SEKV App. C): each is SEKV with one part replaced (:mod:`kv_sekv.ablations`)."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sekv_testkit import context, router

import kv_sekv
from kv_sekv import SEKVConfig, routing_summaries
from kv_sekv.ablations import evenly_spaced_segmentation
from kv_sekv.segmentation import fit_segmentation
from kvcore import Budget, reference_attention, registry


def test_untrained_router_has_the_shipped_shapes_and_identity_but_not_its_weights():
    shipped = kv_sekv.ShippedRouter("smollm2-135m").resolve()
    source = kv_sekv.UntrainedRouter()
    router = source.resolve(3, 64)
    assert source.resolve(3, 64) is router  # built once
    dims = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "model_id")
    assert [getattr(router, d) for d in dims] == [getattr(shipped, d) for d in dims]
    assert router.W.shape == shipped.W.shape and not torch.allclose(router.W, shipped.W)
    assert torch.all(router.tau == router.config.tau_init)  # one threshold for every head, unlike the trained τ
    assert not torch.all(shipped.tau == shipped.config.tau_init)
    again = kv_sekv.UntrainedRouter().resolve(3, 64)
    assert torch.equal(again.W, router.W)  # deterministic


def test_sekv_untrained_is_sekv_with_the_untrained_router_and_is_registered():
    c = kv_sekv.sekv_untrained(budget=0.2)
    base = kv_sekv.sekv(budget=0.2)
    assert c.name == "sekv-untrained" and c.budget == base.budget and c.budget.ratio == pytest.approx(0.8)
    assert type(c.scorer) is type(base.scorer) and type(c.selector) is type(base.selector)
    m = registry.discover()["sekv-untrained"]
    assert m.budgets == frozenset({"ratio"}) and m.build(Budget(ratio=0.9)).name == "sekv-untrained"


ZOOM = SEKVConfig(window=4, min_span=3, max_rank=8, proj_dim=8, zoom_share=0.5)
ABLATIONS = {
    "sekv-untrained": kv_sekv.sekv_untrained,
    "sekv-no-svd": kv_sekv.sekv_no_svd,
    "sekv-fixed-spans": kv_sekv.sekv_fixed_spans,
    "sekv-global-tau": kv_sekv.sekv_global_threshold,
    "sekv-mean-pool": kv_sekv.sekv_mean_pooling,
}


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_each_ablation_is_registered_and_builds_sekv_with_one_part_replaced(name):
    c = ABLATIONS[name](budget=0.2)
    base = kv_sekv.sekv(budget=0.2)
    assert c.name == name and c.budget == base.budget
    assert c.selector.config == base.selector.config and isinstance(c.selector, kv_sekv.SpanSelector)
    built = registry.discover()[name].build(Budget(ratio=0.8))
    assert built.name == name and built.selector.config.budget == pytest.approx(0.2)
    assert type(built.selector) is type(c.selector)
    assert built.new_store().reconstruct is (name != "sekv-no-svd")


def _compress(selector_cls=kv_sekv.SpanSelector, reconstruct=True, budget=0.4, seed=0, T=96):
    r = router(Hq=4, Hkv=2, config=ZOOM, tau=0.05, seed=seed)
    c = kv_sekv.sekv(budget, r, ZOOM, reconstruct=reconstruct)
    c = dataclasses.replace(c, selector=selector_cls(c.selector.config, c.selector.strict, c.selector.router))
    x = context(B=1, Hkv=2, T=T, seed=seed)
    return c.compress(x), x, r


@pytest.mark.parametrize("seed", range(3))
def test_no_svd_keeps_no_span_basis_never_expands_and_attends_the_coarse_view(seed):
    store, _, _ = _compress(reconstruct=False, seed=seed)
    full, _, _ = _compress(seed=seed)
    q = torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(seed)) * 3
    out, _ = store.attend(q)
    assert store.last_step.selected > 0 and store.last_step.expanded == 0 and store.last_step.fetched_bytes == 0
    want, _ = reference_attention(store.read(), q)
    torch.testing.assert_close(out, want)
    assert store.bytes_by_tier()["bases"] == 0 < full.bytes_by_tier()["bases"]
    assert store.bytes_by_tier()["resident"] == full.bytes_by_tier()["resident"]  # the same accelerator tier
    full.attend(q)
    assert full.last_step.expanded > 0  # the same case expands spans with reconstruction on


@settings(max_examples=25, deadline=None)
@given(st.integers(40, 300), st.sampled_from((0.3, 0.5, 1.0)), st.sampled_from((0.0, 0.75)), st.integers(0, 10_000))
def test_evenly_spaced_segmentation_moves_boundaries_at_no_extra_cost(n, share, summary_cost, seed):
    """Same window, a persistent part no larger than SEKV's, boundaries evenly spaced from the first token (span
    lengths differ by at most one) and set by the counts only, not by where the surprisal peaks."""
    h = torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 6
    opts = dict(alpha=1.0, min_span=3, window=8, capacity=int(n * share), summary_cost=summary_cost, strict=True)
    seg = fit_segmentation(h, **opts)
    even = evenly_spaced_segmentation(seg, 3)
    body = n - seg.window
    assert even.window == seg.window and torch.all(even.span_id[body:] == -1)
    assert even.cost <= seg.cost + 1e-9
    if seg.n_spans == 0:
        assert even is seg
        return
    assert bool(even.anchors[0]) and even.n_spans >= 1
    lens = torch.bincount(even.span_id[even.span_id >= 0])
    assert lens.numel() == even.n_spans and int(lens.max() - lens.min()) <= 1 and int(lens.min()) >= 3
    assert int((even.span_id < 0).sum()) == even.n_spans + seg.window  # one boundary token per span, the window
    # the persistent part is SEKV's: resident tokens + spans at SEKV's cost per span
    per_span = (seg.cost - int((seg.span_id < 0).sum())) / seg.n_spans
    assert even.cost == pytest.approx(int((even.span_id < 0).sum()) + even.n_spans * per_span)
    shuffled = h[torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))]
    other = fit_segmentation(shuffled, **opts)
    if other.cost == seg.cost and other.n_spans == seg.n_spans:
        assert torch.equal(evenly_spaced_segmentation(other, 3).span_id, even.span_id)


def test_fixed_spans_selector_writes_evenly_spaced_spans():
    store, _x, _ = _compress(kv_sekv.FixedSpanSelector)
    entropy, _, _ = _compress()
    lens = store._spans.length[0]
    lens = lens[lens > 0]
    assert int(lens.max() - lens.min()) <= 1
    assert not torch.equal(store._spans.length, entropy._spans.length)


def test_global_threshold_router_sets_every_tau_to_the_mean_and_keeps_w():
    base = router(L=2, Hq=4, Hkv=2, config=ZOOM, seed=1)
    with torch.no_grad():
        base.tau.copy_(torch.rand(base.tau.shape, generator=torch.Generator().manual_seed(0)))
    source = kv_sekv.GlobalThresholdRouter(base)
    r = source.resolve()
    assert source.resolve() is r and r is not base
    torch.testing.assert_close(r.tau, torch.full_like(base.tau, float(base.tau.detach().mean())))
    assert torch.equal(r.W, base.W) and not torch.equal(base.tau, r.tau)
    with pytest.raises(TypeError, match="base must be"):
        kv_sekv.GlobalThresholdRouter(object())


def test_mean_pooling_averages_span_tokens_uniformly():
    store, x, r = _compress(kv_sekv.MeanPoolingSelector)
    sp = store._spans
    for s, pos in enumerate(sp.token_pos[0]):
        torch.testing.assert_close(sp.coarse_k[0, :, s].float(), x.keys[0][:, pos].float().mean(1))
        torch.testing.assert_close(sp.coarse_v[0, :, s].float(), x.values[0][:, pos].float().mean(1))
    want = routing_summaries(sp.coarse_k.float(), r.layer(0).W)
    torch.testing.assert_close(sp.summary.float(), want)
    weighted, _, _ = _compress()
    assert not torch.allclose(weighted._spans.coarse_k, sp.coarse_k)
