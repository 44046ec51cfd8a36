"""The standard-tests base: flags, flag-named skips, hypothesis settings, the no-override guard (langchain-tests
``BaseStandardTests``, langchain-ai/langchain ``libs/standard-tests``) and the storage walker re-exported from
:mod:`kvcore.memory`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcore.context import ScoringContext
from kvcore.memory import reachable_bytes, reachable_tensors  # noqa: F401  (re-exported)
from kvcore.testing.strategies import KVSample

MAX_EXAMPLES = 15


def forall(strategy: st.SearchStrategy, check: Callable[[Any], None], max_examples: int = MAX_EXAMPLES) -> None:
    """Run ``check(example)`` over ``strategy``: few examples, no deadline, no database, one reported failure.
    Other settings come from the loaded hypothesis profile."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(example=strategy)
    def run(example: Any) -> None:
        check(example)

    run()


def overridden_standard_tests(cls: type) -> list[str]:
    """Standard tests that ``cls`` overrides or deletes without ``@pytest.mark.xfail(reason=...)``."""
    suites = [c for c in cls.__mro__ if c.__module__.startswith("kvcore.testing") and issubclass(c, StandardTests)]
    bad = []
    for name in sorted({n for s in suites for n in dir(s) if n.startswith("test_")}):
        mine = getattr(cls, name, None)
        xfail = any(m.name == "xfail" and m.kwargs.get("reason") for m in getattr(mine, "pytestmark", []))
        if mine is not next(getattr(s, name) for s in suites if hasattr(s, name)) and not xfail:
            bad.append(name)
    return bad


class StandardTests:
    """Base of every suite. Capability flags are class attributes; ``None`` means "read it from the object"."""

    def test_no_overrides_DO_NOT_OVERRIDE(self) -> None:
        """A standard test is overridden or deleted only with ``@pytest.mark.xfail(reason=...)``.

        Troubleshooting: do not redefine a standard test to make it pass; fix the implementation, turn the feature off
        with its capability flag, or mark the override ``@pytest.mark.xfail(reason="why the method differs")`` so the
        deviation is visible in every test run."""
        bad = overridden_standard_tests(type(self))
        assert not bad, f"standard tests overridden without @pytest.mark.xfail(reason='...'): {bad}"

    def flag(self, name: str, default: Any = None) -> Any:
        """Capability flag ``name``, or ``default`` (introspected from the object) when it is ``None``."""
        return default if getattr(self, name) is None else getattr(self, name)

    def require(self, ok: Any, reason: str) -> None:
        """Skip the calling test unless ``ok``; ``reason`` names the capability flag that turned it off."""
        if not ok:
            pytest.skip(f"skipped by capability flag: {reason}")


class ContextTests(StandardTests):
    """Builds scoring contexts that supply what a scorer declares (``needs_queries``, ``needs_extras``)."""

    def make_extras(self, shapes: dict[str, Any]) -> dict[str, Any]:
        """Extras the scorer declares in ``needs_extras`` (override when it declares any). ``shapes`` holds
        ``B, Hkv, Hq, T, W, D`` (ints), ``dtype`` and ``seed`` (seed a ``torch.Generator`` with it)."""
        return {}

    def make_context(
        self, scorer: Any, x: KVSample, queries: bool | None = None, extras: bool = True, **kw: Any
    ) -> ScoringContext:
        """A context over ``x`` with queries (default: if ``scorer.needs_queries``) and the declared extras."""
        needs, ex = frozenset(scorer.needs_extras), {}
        if extras and needs:
            ex = dict(self.make_extras(x.shapes()))
            if needs - set(ex):
                raise NotImplementedError(f"scorer needs extras {sorted(needs - set(ex))}: override make_extras()")
        q = x.queries if (scorer.needs_queries if queries is None else queries) else None
        return ScoringContext(x.keys, x.values, q, attention_mask=x.attention_mask, extras=ex, **kw)
