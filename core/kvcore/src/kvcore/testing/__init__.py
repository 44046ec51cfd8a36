"""Conformance suites for the kvcore protocols (DESIGN.md §3), in the langchain-tests "standard tests" pattern.

A method adopts a suite by subclassing it in its own test module and supplying one fixture::

    import pytest
    from kvcore.testing import ScorerTests

    class TestKeyNorm(ScorerTests):
        @pytest.fixture
        def scorer(self):
            return KeyNorm()

================  =================  ===========================================================================
suite             fixture            capability flags (class attributes) and hooks
================  =================  ===========================================================================
ScorerTests       ``scorer``         ``requires_queries`` (default ``scorer.needs_queries``), ``stochastic``;
                                     hook ``make_extras(shapes)`` for ``needs_extras``
SelectorTests     ``selector``       ``supports_granularities``, ``supports_token_budget``, ``tiered``, ``tiers``,
                                     ``avg_bits_choices``; hook ``expected_shares(selector, budget)``
QuantizerTests    ``quantizer``      ``uniform``, ``divisible_only``
StoreTests        ``store_factory``  ``quantized_bits``, ``supports_crop``, ``supports_reorder``,
                                     ``lossless_full_tier``, ``lossless_append``; hook ``max_quantization_error``
CompressorTests   ``compressor``     ``lossless_at_zero_ratio``, ``evicts``; hook ``make_extras(shapes)``
================  =================  ===========================================================================

Each suite module documents its flags. A flag left at ``None`` is read from the object under test. A standard
test for a feature a flag turns off is skipped, and the skip reason names the flag. Every suite runs
``test_no_overrides_DO_NOT_OVERRIDE``: a standard test overridden (or deleted) without
``@pytest.mark.xfail(reason=...)`` fails it (:func:`overridden_standard_tests` does the check). Properties are
checked with hypothesis (:mod:`kvcore.testing.strategies`), a few examples per test and no deadline, so a suite
runs in seconds on CPU. Needs ``pip install kvcore[testing]``; ``import kvcore`` never imports pytest.
"""

from kvcore.testing.base import StandardTests, forall, overridden_standard_tests
from kvcore.testing.compressor import CompressorTests
from kvcore.testing.quantizer import QuantizerTests, pack_codes, unpack_codes
from kvcore.testing.scorer import ScorerTests
from kvcore.testing.selector import SelectorTests
from kvcore.testing.store import StoreTests
from kvcore.testing.walk import reachable_bytes, reachable_tensors

__all__ = [
    "CompressorTests", "QuantizerTests", "ScorerTests", "SelectorTests", "StandardTests", "StoreTests", "forall",
    "overridden_standard_tests", "pack_codes", "reachable_bytes", "reachable_tensors", "unpack_codes",
]
