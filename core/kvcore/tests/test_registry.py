"""``kvcore.registry``: Method validation, budget kinds, accepts/build, and the collection of entry-point tables
(exercised with in-memory tables through :func:`kvcore.registry.collect`)."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
from kvcore_toys import KeyNorm

from kvcore import Budget, Compressor, DenseStore, Method, TopKSelector, registry


def make(budget: Budget) -> Compressor:
    return Compressor(KeyNorm(), TopKSelector(), DenseStore, budget, name="keynorm")


def test_budget_kind():
    assert registry.budget_kind(Budget(0.5)) == "ratio"
    assert registry.budget_kind(Budget(tokens=8)) == "tokens"
    assert registry.budget_kind(Budget(avg_bits=2.0)) == "avg_bits"
    with pytest.raises(TypeError, match="budget"):
        registry.budget_kind(0.5)


@pytest.mark.parametrize(
    "kwargs, err, words",
    [
        ({"name": ""}, ValueError, "name"),
        ({"name": 3}, ValueError, "name"),
        ({"factory": "not callable"}, TypeError, "factory"),
        ({"budgets": {"ratio", "bits"}}, ValueError, "bits"),
        ({"default": 0.5}, TypeError, "default"),
    ],
)
def test_method_rejects(kwargs, err, words):
    args = {"name": "m", "factory": make, "description": "d", **kwargs}
    with pytest.raises(err, match=words):
        Method(**args)


def test_method_freezes_budget_kinds():
    m = Method("m", make, "d", budgets=["ratio", "avg_bits"])
    assert m.budgets == frozenset({"ratio", "avg_bits"}) and isinstance(m.budgets, frozenset)


def test_accepts_by_kind_or_default():
    m = Method("m", make, "d")  # ratio and tokens
    assert m.accepts(Budget(0.3)) and m.accepts(Budget(tokens=4))
    assert not m.accepts(Budget(avg_bits=2.0))
    fixed = Method("full", make, "the full cache", budgets=frozenset())
    assert fixed.accepts(Budget()) and not fixed.accepts(Budget(0.5))


def test_build_passes_the_budget_and_uses_the_default():
    m = Method("m", make, "d", default=Budget(0.25))
    assert m.build().budget == Budget(0.25)
    built = m.build(Budget(tokens=16, granularity="layer"))
    assert isinstance(built, Compressor) and built.budget == Budget(tokens=16, granularity="layer")


def test_build_refuses_a_budget_kind_it_does_not_take():
    with pytest.raises(ValueError, match="'m'.*avg_bits"):
        Method("m", make, "d").build(Budget(avg_bits=2.0))
    with pytest.raises(ValueError, match="only its default"):
        Method("full", make, "d", budgets=frozenset()).build(Budget(0.5))


def test_build_refuses_a_factory_that_returns_no_compressor():
    with pytest.raises(TypeError, match="not a kvcore.Compressor"):
        Method("bad", lambda b: DenseStore(), "d").build()


def test_with_name():
    m = Method("m", make, "d").with_name("m2")
    assert m.name == "m2" and m.factory is make


def test_collect_merges_tables_by_name():
    a, b, c = Method("a", make, "d"), Method("b", make, "d"), Method("c", make, "d")
    found = registry.collect([("pkg1", [a, b]), ("pkg2", (c,))])
    assert found == {"a": a, "b": b, "c": c}
    assert registry.collect([]) == {}


def test_collect_refuses_a_name_registered_twice():
    a = Method("a", make, "d")
    with pytest.raises(ValueError, match="'a' is registered twice.*pkg2"):
        registry.collect([("pkg1", [a]), ("pkg2", [a.with_name("a")])])


@pytest.mark.parametrize("table", ["a string", 42, [Method("a", make, "d"), "b"], [make]], ids=str)
def test_collect_refuses_tables_that_are_not_sequences_of_methods(table):
    with pytest.raises(TypeError, match="pkg"):
        registry.collect([("pkg", table)])


def test_get_and_build_from_a_given_registry():
    reg = registry.collect([("pkg", [Method("a", make, "d"), Method("b", make, "d")])])
    assert registry.get("b", reg) is reg["b"]
    assert registry.build("a", Budget(0.5), reg).budget == Budget(0.5)
    with pytest.raises(LookupError, match=r"'zzz'.*\['a', 'b'\]"):
        registry.get("zzz", reg)


def test_discover_loads_every_entry_point_of_the_group(monkeypatch):
    """``discover`` loads the tables of the ``kvcompress.methods`` entry points only (here: a fake installed set)."""
    eps = [EntryPoint("toys", "kvcore_toys:TOY_METHODS", registry.GROUP), EntryPoint("other", "math:pi", "other.group")]
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep for ep in eps if ep.group == group])
    found = registry.discover()
    assert sorted(found) == ["keynorm", "keynorm-layer"] and all(isinstance(m, Method) for m in found.values())
    assert registry.build("keynorm-layer", Budget(0.5, granularity="layer"), found).budget.granularity == "layer"
    eps.append(EntryPoint("again", "kvcore_toys:TOY_METHODS", registry.GROUP))
    with pytest.raises(ValueError, match="registered twice"):
        registry.discover()
