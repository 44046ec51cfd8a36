"""PyramidKV: per-layer counts follow kvpress's formula, sum to the uniform budget, and each layer is top-k per head."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_baselines as kb
from kv_baselines.selectors import layer_counts
from kvcore import Budget, Protection, Scores, ScoringContext, registry


def _kvpress_budget(q_len, ratio, window, beta, layers, layer_idx):
    """kvpress ``PyramidKVPress.get_layer_budget``, transcribed (rounds each layer; may miss the total by a few)."""
    cap = window + q_len * (1 - ratio)
    lo = (cap - window) / beta
    hi = (cap - window) * 2 - lo
    if hi >= q_len - window:
        hi = q_len - window
        lo = (cap - window) * 2 - hi
    if not (q_len >= hi >= lo >= window):
        return round(q_len * (1 - ratio))
    return round(hi - layer_idx * (hi - lo) / (layers - 1))


@settings(max_examples=200, deadline=None)
@given(
    m=st.integers(4, 200),
    ratio=st.sampled_from([0.25, 0.5, 0.75, 0.9]),
    layers=st.integers(2, 40),
    beta=st.sampled_from([1.0, 2.0, 20.0]),
)
def test_counts_follow_kvpress_and_sum_exactly(m, ratio, layers, beta):
    n, window = 20 * m, 64  # n * (1 - ratio) is whole: kvpress's mean per layer is ours
    kept = Budget(ratio=ratio).kept(n)
    counts = layer_counts(kept, n, window, layers, beta)
    assert sum(counts) == layers * kept
    assert all(window <= c <= n for c in counts) or counts == [kept] * layers
    assert counts == sorted(counts, reverse=True)
    ref = [_kvpress_budget(n, ratio, window, beta, layers, i) for i in range(layers)]
    # kvpress rounds every layer on its own; ours differ by that rounding only
    assert all(abs(a - b) <= 1 for a, b in zip(counts, ref)), (counts, ref)


def test_one_layer_and_infeasible_pyramids_are_uniform():
    assert layer_counts(10, 20, 4, 1, 20.0) == [10]
    assert layer_counts(10, 20, 8, 5, 20.0) == [12, 11, 10, 9, 8]  # capped at n - protected, down to protected
    assert layer_counts(10, 20, 11, 5, 20.0) == [10] * 5  # no sequence keeps >= 11 everywhere and <= 9 on top


def _naive_plan(scores, counts, valid):
    """Per layer, per head: the ``counts[l]`` valid entries of highest score, ties to the lower index."""
    L, B, H, T = scores.shape
    keep = torch.zeros(L, B, H, T, dtype=torch.bool)
    for lay in range(L):
        for b in range(B):
            for h in range(H):
                order = sorted((t for t in range(T) if valid[b, t]), key=lambda t: (-float(scores[lay, b, h, t]), t))
                for t in order[: counts[b][lay]]:
                    keep[lay, b, h, t] = True
    return keep


@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.8])
def test_selector_matches_naive_topk_per_layer(ratio):
    g = torch.Generator().manual_seed(1)
    L, B, H, T = 5, 2, 3, 50
    scores = torch.rand(L, B, H, T, generator=g)
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, :6] = False
    budget = Budget(ratio=ratio, granularity="global")
    plan = kb.PyramidSelector().select(Scores(scores), budget, None, valid)
    counts = [layer_counts(budget.kept(int(n)), int(n), 0, L, 20.0) for n in valid.sum(-1)]
    assert torch.equal(plan.keep_keys, _naive_plan(scores, counts, valid))
    assert plan.keep_keys.sum(dim=(0, 2, 3)).tolist() == [L * H * budget.kept(int(n)) for n in valid.sum(-1)]


def test_compressor_gives_lower_layers_more_and_keeps_the_window():
    comp = kb.pyramidkv(0.5, window=8)
    g = torch.Generator().manual_seed(0)
    ctxs = [
        ScoringContext(
            torch.randn(1, 2, 100, 8, generator=g),
            torch.randn(1, 2, 100, 8, generator=g),
            queries=torch.randn(1, 4, 8, 8, generator=g),
            layer_idx=i,
        )
        for i in range(4)
    ]
    stores = comp.compress_layers(ctxs)
    lengths = [int(s.seq_lengths()[0, 0]) for s in stores]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1] and sum(lengths) == 4 * 50
    for plan in comp.plan_layers(ctxs):
        assert bool(plan.keep_keys[..., -8:].all())


def test_registered_and_bad_input():
    c = registry.discover()["pyramidkv"].build(Budget(ratio=0.75))
    assert c.name == "pyramidkv" and c.budget.ratio == 0.75 and c.budget.granularity == "global"
    assert isinstance(c.selector, kb.PyramidSelector) and c.selector.beta == 20.0
    assert c.scorer.window == 64 and c.scorer.kernel_size == 5 and c.protect == Protection(recent=64)
    with pytest.raises(ValueError, match="beta"):
        kb.PyramidSelector(beta=0.5)
    with pytest.raises(TypeError, match="beta"):
        kb.PyramidSelector(beta="20")
    with pytest.raises(TypeError, match="scores"):
        kb.PyramidSelector().select(torch.ones(1, 1, 4), Budget(ratio=0.5))
