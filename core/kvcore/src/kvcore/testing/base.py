"""The standard-tests base: capability flags, flag-named skips, hypothesis settings and the no-override guard.

Follows langchain-tests ``BaseStandardTests`` (anchors §8): a standard test may only be overridden with
``@pytest.mark.xfail(reason=...)``, so a method cannot silently weaken the contract it claims.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.context import ScoringContext
from kvcore.testing.strategies import KVSample

SUITE_MODULE_PREFIX = "kvcore.testing"
MAX_EXAMPLES = 15


def forall(strategy: st.SearchStrategy, check: Callable[[Any], None], max_examples: int = MAX_EXAMPLES) -> None:
    """Run ``check(example)`` over ``strategy`` with few examples and no deadline (suites stay fast on CPU)."""
    @settings(max_examples=max_examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(example=strategy)
    def run(example: Any) -> None:
        check(example)

    run()


def overridden_standard_tests(cls: type) -> list[str]:
    """Standard tests of the kvcore suites that ``cls`` overrides or deletes without
    ``@pytest.mark.xfail(reason=...)``; empty when ``cls`` runs every standard test as written."""
    suites = [c for c in cls.__mro__ if c.__module__.startswith(SUITE_MODULE_PREFIX) and issubclass(c, StandardTests)]
    names = sorted({n for s in suites for n in dir(s) if n.startswith("test_")})
    bad = []
    for name in names:
        reference = next(getattr(s, name) for s in suites if hasattr(s, name))
        mine = getattr(cls, name, None)
        marks = getattr(mine, "pytestmark", [])
        if mine is not reference and not any(m.name == "xfail" and m.kwargs.get("reason") for m in marks):
            bad.append(name)
    return bad


class StandardTests:
    """Base of every suite. Capability flags are class attributes; ``None`` means "read it from the object"."""

    def test_no_overrides_DO_NOT_OVERRIDE(self) -> None:
        """A standard test is overridden or deleted only with ``@pytest.mark.xfail(reason=...)``."""
        bad = overridden_standard_tests(type(self))
        assert not bad, f"standard tests overridden without @pytest.mark.xfail(reason='...'): {bad}"

    def flag(self, name: str, default: Any = None) -> Any:
        """Value of capability flag ``name``; ``default`` (introspected from the object) when it is ``None``."""
        value = getattr(self, name)
        return default if value is None else value

    def require(self, ok: Any, reason: str) -> None:
        """Skip the calling test unless ``ok``; ``reason`` names the capability flag that turned it off."""
        if not ok:
            pytest.skip(f"skipped by capability flag: {reason}")


class ContextTests(StandardTests):
    """Builds scoring contexts that supply what a scorer declares (``needs_queries``, ``needs_extras``)."""

    def make_extras(self, shapes: dict[str, Any]) -> dict[str, Any]:
        """Extras the scorer declared in ``needs_extras``; override when it declares any.

        ``shapes`` holds ``B, Hkv, Hq, T, W, D`` (ints), ``dtype`` and ``seed`` (for a ``torch.Generator``).
        """
        return {}

    def make_context(self, scorer: Any, sample: KVSample, queries: bool | None = None, extras: bool = True,
                     **kw: Any) -> ScoringContext:
        """A context over ``sample``; queries by default only if ``scorer.needs_queries``, extras if declared."""
        needs = frozenset(getattr(scorer, "needs_extras", frozenset()))
        ex = {}
        if extras and needs:
            ex = dict(self.make_extras(sample.shapes()))
            if needs - set(ex):
                raise NotImplementedError(f"scorer needs extras {sorted(needs - set(ex))}: override make_extras()")
        queries = getattr(scorer, "needs_queries", False) if queries is None else queries
        q = sample.queries if queries else None
        return ScoringContext(sample.keys, sample.values, q, attention_mask=sample.attention_mask, extras=ex, **kw)
