"""Table 5 "w/o trained zoom-in": the same SEKV with the untrained router of the shipped router's shapes."""

import pytest
import torch

import kv_sekv
from kvcore import Budget, registry


def test_untrained_router_has_the_shipped_shapes_and_identity_but_not_its_weights():
    shipped = kv_sekv.ShippedRouter().resolve()
    source = kv_sekv.UntrainedRouter()
    router = source.resolve()
    assert source.resolve() is router  # built once
    dims = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "model_id")
    assert [getattr(router, d) for d in dims] == [getattr(shipped, d) for d in dims]
    assert router.W.shape == shipped.W.shape and not torch.allclose(router.W, shipped.W)
    assert torch.all(router.tau == router.config.tau_init)  # one threshold for every head, unlike the trained τ
    assert not torch.all(shipped.tau == shipped.config.tau_init)
    again = kv_sekv.UntrainedRouter().resolve()
    assert torch.equal(again.W, router.W)  # deterministic


def test_sekv_untrained_is_sekv_with_the_untrained_router_and_is_registered():
    c = kv_sekv.sekv_untrained(budget=0.2)
    base = kv_sekv.sekv(budget=0.2)
    assert c.name == "sekv-untrained" and c.budget == base.budget and c.budget.ratio == pytest.approx(0.8)
    assert type(c.scorer) is type(base.scorer) and type(c.selector) is type(base.selector)
    m = registry.discover()["sekv-untrained"]
    assert m.budgets == frozenset({"ratio"}) and m.build(Budget(ratio=0.9)).name == "sekv-untrained"
