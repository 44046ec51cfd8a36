"""KVzipScorer reads the adapter-provided ``"kvzip_scores"`` extra; kvzip() composes it with a global top-k."""

import pytest
import torch

from kv_baselines import KVzipScorer, kvzip
from kvcore import Budget, ScoringContext, TopKSelector


def _ctx(extras, B=1, H=2, T=5, mask=None):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(B, H, T, 4, generator=g)
    return ScoringContext(k, torch.randn(B, H, T, 4, generator=g), attention_mask=mask, extras=extras)


def test_scores_are_the_provided_extra():
    s = torch.rand(1, 2, 5)
    assert KVzipScorer.needs_extras == frozenset({"kvzip_scores"})
    assert torch.equal(KVzipScorer().score(_ctx({"kvzip_scores": s})).keys, s)


def test_bad_extras_are_refused():
    with pytest.raises(ValueError, match="kvzip_scores"):
        KVzipScorer().score(_ctx({}))
    with pytest.raises(ValueError, match=r"shape \(1, 2, 5\)"):
        KVzipScorer().score(_ctx({"kvzip_scores": torch.zeros(1, 5)}))
    bad = torch.zeros(1, 2, 5)
    bad[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        KVzipScorer().score(_ctx({"kvzip_scores": bad}))
    # non-finite values on padding are allowed (and zeroed)
    mask = torch.tensor([[True, True, False, True, True]])
    assert bool(torch.isfinite(KVzipScorer().score(_ctx({"kvzip_scores": bad}, mask=mask)).keys).all())


def test_kvzip_compressor_selects_the_highest_scores_over_all_layers():
    comp = kvzip(0.5)
    assert isinstance(comp.scorer, KVzipScorer) and comp.selector == TopKSelector(head_floor=0.0)
    assert comp.budget == Budget(ratio=0.5, granularity="global")
    scores = [torch.tensor([[[9.0, 8, 7, 6, 5], [0.1, 0.2, 0.3, 0.4, 0.5]]]), torch.full((1, 2, 5), 1.0)]
    plans = comp.plan_layers([_ctx({"kvzip_scores": s}) for s in scores])
    kept = sum(int(p.keep_keys.sum()) for p in plans)
    assert kept == 2 * 2 * Budget(ratio=0.5).kept(5)
    assert bool(plans[0].keep_keys[0, 0].all())  # the five highest scores of the model are layer 0 head 0


def test_kvzip_uniform_keeps_the_same_share_in_every_layer_and_head():
    """Invariant: ``kvzip-uniform`` (KVzip's 'pair-uniform' level) keeps ``Budget.kept(T)`` entries in each layer and
    KV head, the highest-scored there, where the global ``kvzip`` lets one layer's high scores starve another."""
    from kvcore import registry

    uniform, glob = (registry.discover()[n].build(Budget(ratio=0.6)) for n in ("kvzip-uniform", "kvzip"))
    assert uniform.name == "kvzip-uniform" and uniform.budget.granularity == "head"
    scores = [torch.tensor([[[9.0, 8, 7, 6, 5], [0.1, 0.2, 0.3, 0.4, 0.5]]]), torch.full((1, 2, 5), 1.0)]
    want = Budget(ratio=0.6).kept(5)
    plans = uniform.plan_layers([_ctx({"kvzip_scores": s}) for s in scores])
    for p in plans:
        assert p.keep_keys.sum(-1).tolist() == [[want, want]]
    assert plans[0].keep_keys[0, 1].tolist() == [False, False, False, True, True]  # the top scores of that head
    starved = glob.plan_layers([_ctx({"kvzip_scores": s}) for s in scores])
    assert int(starved[0].keep_keys[0, 1].sum()) == 0  # the global threshold leaves head 1 of layer 0 nothing
