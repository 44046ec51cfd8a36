"""Suites over named cases: one test class runs a conformance suite over several objects, and over registered methods.

A method package's ``test_conformance.py`` declares, per suite, the objects it builds (``cases``: ``{test id:
factory}``) or the registered methods it runs (``methods``: registry names), and hands parametrization to
:func:`parametrize_cases`::

    from kvcore.testing.cases import RegisteredMethods, ScorerCases, objects, parametrize_cases

    pytest_generate_tests = parametrize_cases


    class ScorerSuite(ScorerCases):  # this package's base: coverage() reads its subclasses
        pass


    class TestMyScorer(ScorerSuite):
        cases = objects(default=MyScorer, small_window=lambda: MyScorer(window=4))


    class TestMyMethods(RegisteredMethods):
        methods = ("my-method", "my-method-fast")

:func:`covered` then lists the ``(part, class)`` pairs a package's suites run on, and :func:`methods_run` the
method names, so a coverage test can compare them with what the package registers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

import pytest

from kvcore.budget import Budget
from kvcore.testing.compressor import CompressorTests
from kvcore.testing.quantizer import QuantizerTests
from kvcore.testing.scorer import ScorerTests
from kvcore.testing.selector import SelectorTests
from kvcore.testing.store import StoreTests

__all__ = [
    "QuantizerCases",
    "RegisteredMethods",
    "ScorerCases",
    "SelectorCases",
    "StoreCases",
    "covered",
    "methods_run",
    "objects",
    "parametrize_cases",
]


def objects(**factories: Callable[[], object]) -> Mapping[str, Callable[[], object]]:
    """The objects a suite class runs on, ``{test id: factory}`` (read-only)."""
    return MappingProxyType(factories)


class ScorerCases(ScorerTests):
    """:class:`~kvcore.testing.ScorerTests` once per scorer ``cases`` builds."""

    cases: Mapping[str, Callable[[], object]] = objects()

    @pytest.fixture
    def scorer(self, case):
        return self.cases[case]()


class SelectorCases(SelectorTests):
    """:class:`~kvcore.testing.SelectorTests` once per selector ``cases`` builds."""

    cases: Mapping[str, Callable[[], object]] = objects()

    @pytest.fixture
    def selector(self, case):
        return self.cases[case]()


class QuantizerCases(QuantizerTests):
    """:class:`~kvcore.testing.QuantizerTests` once per quantizer ``cases`` builds."""

    cases: Mapping[str, Callable[[], object]] = objects()

    @pytest.fixture
    def quantizer(self, case):
        return self.cases[case]()


class StoreCases(StoreTests):
    """:class:`~kvcore.testing.StoreTests` once per store factory in ``cases`` (the factory itself is the fixture)."""

    cases: Mapping[str, Callable[[], object]] = objects()

    @pytest.fixture
    def store_factory(self, case):
        return self.cases[case]


class RegisteredMethods(CompressorTests):
    """:class:`~kvcore.testing.CompressorTests` once per registered method in ``methods`` (registry names), each
    built by :func:`kvcore.registry.build` at ``budget`` (the method's default when None)."""

    methods: tuple[str, ...] = ()
    budget: Budget | None = None

    @pytest.fixture
    def compressor(self, method):
        from kvcore import registry

        return registry.build(method, self.budget)


def parametrize_cases(metafunc: pytest.Metafunc) -> None:
    """A test module's ``pytest_generate_tests``: parametrize ``case`` over the class's ``cases`` and ``method`` over
    its ``methods``."""
    for name, attr in (("case", "cases"), ("method", "methods")):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, list(getattr(metafunc.cls, attr)))


def covered(suites: Mapping[str, type]) -> set[tuple[str, type]]:
    """``(part, class)`` of every object the subclasses of ``suites`` (``{part name: a package's case base}``) build."""
    return {
        (part, type(make()))
        for part, base in suites.items()
        for cls in base.__subclasses__()
        for make in cls.cases.values()
    }


def methods_run(bases: Iterable[type]) -> set[str]:
    """Method names the subclasses of ``bases`` (a package's :class:`RegisteredMethods` bases) run."""
    return {name for base in bases for cls in base.__subclasses__() for name in cls.methods}
