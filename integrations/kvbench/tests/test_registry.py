"""Every method the installed packages register (``kvcore.registry``), as kvbench sees them.

Invariants: each builds a ``kvcore.Compressor`` at its default and at a budget of every kind it declares, and
that compressor keeps what the budget says; a kind it does not declare is refused with ``ValueError``; HubKV
entries declare their base's kinds and refuse a base that is not registered, listing what is.
"""

from __future__ import annotations

import pytest
import torch

from kvcore import Budget, Compressor, ScoringContext
from kvcore.registry import BUDGET_KINDS, budget_kind, discover

REGISTRY = discover()
# SmolLM2-135M's layer shape: the shipped FastKVzip gate is trained for it (3 KV heads of 64 channels)
B, HKV, HQ, T, D = 1, 3, 9, 256, 64
AT_KIND = {"ratio": Budget(ratio=0.5), "tokens": Budget(tokens=100), "avg_bits": Budget(avg_bits=3.0)}
KEPT = {"ratio": T // 2, "tokens": 100}


def test_the_workspace_registers_the_known_methods():
    expect = {
        "full",
        "random",
        "knorm",
        "streaming_llm",
        "snapkv",
        "h2o",
        "kivi-4",
        "kivi-2",
        "kvzip",
        "kvzip-uniform",
        "hubkv",
        "hubkv-snapkv",
        "hubkv-h2o",
        "hubkv-kvzip",
        "sekv",
        "sekv-short-spans",
        "sekv-untrained",
        "sekv-no-svd",
        "sekv-fixed-spans",
        "sekv-global-tau",
        "sekv-mean-pool",
        "chunkkv",
        "hqekv-3.2-no-range",
        "hqekv-3.2-random-ratio",
        "hqekv-3.2-no-evict",
        "hqekv-3.2-uniform",
        "hqekv-2-random-ratio",
        "hqekv-smollm2-2",
        "hqekv-smollm2-3.2",
        "hqekv-2",
        "hqekv-2.8",
        "hqekv-3.2",
        "hqekv-3.25",
        "hqekv-qwen3-2",
        "hqekv-qwen3-2.8",
        "hqekv-qwen3-3.2",
        "hex-3",
        "hex-4",
        "kcvt-3",
        "kcvt-4",
        "hex-expander-only-3",
        "hex-h2o-only-3",
        "hex-random-mask-3",
        "expected_attention",
        "pyramidkv",
        "sentencekv",
        "fastkvzip",
        "hubkv-fastkvzip",
        "sekv-unbounded-spans",
    }
    assert set(REGISTRY) == expect
    assert all(m.description and "\n" not in m.description for m in REGISTRY.values())


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_builds_at_its_default_and_at_every_declared_kind(name):
    method = REGISTRY[name]
    assert isinstance(method.build(), Compressor)
    assert method.build().budget.ratio == method.default.ratio and method.build().budget.tokens == method.default.tokens
    for kind in method.budgets:
        budget = AT_KIND[kind]
        comp = method.build(budget)
        assert isinstance(comp, Compressor)
        assert budget_kind(comp.budget) == kind
        assert (comp.budget.ratio, comp.budget.tokens) == (budget.ratio, budget.tokens)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_kind_not_declared_is_refused(name):
    method = REGISTRY[name]
    refused = [k for k in BUDGET_KINDS if k not in method.budgets]
    assert refused, f"{name} declares every kind: nothing to refuse"  # no method takes avg_bits yet
    for kind in refused:
        with pytest.raises(ValueError, match=f"method {name!r} takes budgets by"):
            method.build(AT_KIND[kind])


# what an adapter's provider would supply for each extra a registered scorer declares, in the provider's shape
EXTRAS = {
    "kvzip_scores": lambda g: torch.rand(B, HKV, T, generator=g),  # KVzip's reconstruction scores
    "rope_inv_freq": lambda g: 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D),  # RoPE, base 1e4
    "sentence_ids": lambda g: torch.randint(0, 2, (B, T), generator=g).cumsum(-1),  # a sentence per 2 tokens
    "surprisal": lambda g: torch.rand(B, T, generator=g) * 8,  # nats per token
}


def test_every_declared_extra_has_a_synthetic_supply():
    """Invariant: a registered scorer's extra that this file cannot supply fails here by name, not as a KeyError
    deep in a parametrized test."""
    declared = {x for method in REGISTRY.values() for x in method.build().scorer.needs_extras}
    assert declared <= set(EXTRAS), sorted(declared - set(EXTRAS))


def _context(comp: Compressor) -> ScoringContext:
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(B, HKV, T, D, generator=g), torch.randn(B, HKV, T, D, generator=g)
    window = comp.scorer.query_window or T
    queries = torch.randn(B, HQ, window, D, generator=g) if comp.scorer.needs_queries else None
    extras = {name: EXTRAS[name](g) for name in comp.scorer.needs_extras}
    return ScoringContext(keys, values, queries, layer_idx=0, extras=extras, budget=comp.budget)


# SEKV keeps a segmentation-dependent count (resident tokens + one coarse entry per span) and needs a router trained
# for the model; kv-sekv's own tests check its budget rule
SEGMENTED = {name for name in REGISTRY if name.startswith("sekv")}
# a method whose budget is an average bit width keeps a count set by its tier shares (HqeKV: blocks evicted by
# share, fp16 top blocks on top); kv-hqekv's tests check the achieved bits against the shares' rounding bound
TIERED = {name for name, method in REGISTRY.items() if method.default.avg_bits is not None}


@pytest.mark.parametrize("name", sorted(set(REGISTRY) - SEGMENTED - TIERED))
def test_the_built_compressor_keeps_what_the_budget_says(name):
    method = REGISTRY[name]
    cases = [(method.default, T)] + [(AT_KIND[k], KEPT[k]) for k in sorted(method.budgets)]
    for budget, kept in cases:
        comp = method.build(budget)
        (store,) = comp.compress_layers([_context(comp)])  # one layer; "global" budgets need the layer list
        assert int(store.seq_lengths().sum()) == HKV * kept, (name, budget)


def test_kivi_is_plain_at_ratio_0_and_composes_snapkv_eviction_above():
    for bits in (2, 4):
        method = REGISTRY[f"kivi-{bits}"]
        assert method.build(Budget(ratio=0.0)).name == f"kivi-{bits}"
        assert method.build(Budget(ratio=0.5)).name == f"snapkv+kivi-{bits}"
        assert method.build(Budget(tokens=100)).name == f"snapkv+kivi-{bits}"


def test_full_takes_only_its_default():
    full = REGISTRY["full"]
    assert full.budgets == frozenset() and full.accepts(Budget())
    with pytest.raises(ValueError, match="only its default"):
        full.build(Budget(ratio=0.5))


@pytest.mark.parametrize("name", [n for n in sorted(REGISTRY) if n.startswith("hubkv-")])
def test_hubkv_entries_take_their_base_budgets(name):
    base = REGISTRY[name.removeprefix("hubkv-")]
    assert REGISTRY[name].budgets == base.budgets
    comp = REGISTRY[name].build(Budget(ratio=0.75))
    assert comp.scorer.base == base.build(Budget(ratio=0.75)).scorer


def test_hubkv_refuses_a_missing_base_listing_the_registered_methods():
    from kv_hubkv.registry import over

    with pytest.raises(LookupError, match="'no_such_base'") as info:
        over("no_such_base").build(Budget(ratio=0.5))
    assert all(repr(name) in str(info.value) for name in REGISTRY)
