"""The registered method ``sekv`` (entry-point group ``kvcompress.methods``)."""

import pytest

from kv_sekv import SEKVStore, SpanSelector, SurprisalScorer
from kv_sekv.registry import METHODS
from kvcore import Budget
from kvcore import registry as kvregistry


def test_sekv_is_registered_and_builds_by_ratio():
    method, short, *ablations, unbounded = METHODS
    assert unbounded.name == "sekv-unbounded-spans" and unbounded.build().selector.config.max_span is None
    assert method.build().selector.config.max_span == 64
    assert method.name == "sekv" and method.budgets == {"ratio"}
    assert short.name == "sekv-short-spans" and short.build().selector.config.max_span == "auto"
    assert [a.name for a in ablations] == [
        "sekv-untrained",
        "sekv-no-svd",
        "sekv-fixed-spans",
        "sekv-global-tau",
        "sekv-mean-pool",
    ]
    assert all(a.budgets == {"ratio"} for a in ablations)
    assert "sekv" in kvregistry.discover()
    c = method.build()
    assert c.budget.ratio == pytest.approx(0.9)  # the paper's 10 % accelerator budget
    assert isinstance(c.scorer, SurprisalScorer) and isinstance(c.selector, SpanSelector)
    assert isinstance(c.new_store(), SEKVStore) and c.new_store() is not c.new_store()
    assert method.build(Budget(ratio=0.8)).selector.config.budget == pytest.approx(0.2)
    with pytest.raises(ValueError, match="takes budgets by ratio"):
        method.build(Budget(tokens=10))
