"""kvcore.testing.cases: named cases per suite, registered methods, and what a package's suites cover."""

from types import SimpleNamespace

import pytest

from kvcore import DenseStore, TopKSelector
from kvcore.testing.cases import (
    RegisteredMethods,
    SelectorCases,
    StoreCases,
    covered,
    methods_run,
    objects,
    parametrize_cases,
)


class SelectorSuite(SelectorCases):
    """The local base whose subclasses covered() reads."""


class TestTopKThroughCases(SelectorSuite):
    cases = objects(topk=TopKSelector)


class StoreSuite(StoreCases):
    pass


class TestDenseThroughCases(StoreSuite):
    cases = objects(dense=DenseStore)


class Methods(RegisteredMethods):
    pass


class TestFullMethod(Methods):
    methods = ("full",)


pytest_generate_tests = parametrize_cases


def test_covered_and_tested_read_the_local_bases_only():
    assert covered({"selector": SelectorSuite, "store": StoreSuite}) == {
        ("selector", TopKSelector),
        ("store", DenseStore),
    }
    assert methods_run([Methods]) == {"full"}


def test_objects_are_read_only_and_parametrize_uses_them():
    cases = objects(a=int)
    with pytest.raises(TypeError):
        cases["b"] = float  # type: ignore[index]
    calls = []
    metafunc = SimpleNamespace(
        fixturenames=["case"], cls=SimpleNamespace(cases=cases), parametrize=lambda *a: calls.append(a)
    )
    parametrize_cases(metafunc)
    assert calls == [("case", ["a"])]
