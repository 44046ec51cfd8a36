"""Conformance suites for the kvcore protocols, in the langchain-tests "standard tests" pattern.

A method adopts a suite by subclassing it in a test module and supplying one fixture::

    class TestKeyNorm(ScorerTests):
        @pytest.fixture
        def scorer(self):
            return KeyNorm()

===================  =================  ======================================================================
suite                fixture            capability flags (class attributes) and hooks (methods)
===================  =================  ======================================================================
``ScorerTests``      ``scorer``         ``requires_queries``, ``stochastic``; ``make_extras(shapes)``
``SelectorTests``    ``selector``       ``supports_granularities``, ``supports_token_budget``, ``tiered``,
                                        ``tiers``, ``avg_bits_choices``; ``expected_shares(selector, budget)``
``QuantizerTests``   ``quantizer``      ``uniform``, ``divisible_only``
``StoreTests``       ``store_factory``  ``quantized_bits``, ``quantized_key_bits``, ``quantized_value_bits``,
                                        ``same_kv_tiers``, ``supports_crop``, ``supports_reorder``,
                                        ``lossless_full_tier``, ``lossless_append``, ``can_demote``,
                                        ``can_attend``; ``max_quantization_error``
``CompressorTests``  ``compressor``     ``lossless_at_zero_ratio``, ``evicts``; ``make_extras(shapes)``,
                                        ``plan(c, ctx)``, ``write(c, ctx, store)`` (``"global"`` budgets
                                        go through ``plan_layers`` / ``compress_layers``),
                                        ``layer_shapes(c)`` (fixed ``Hkv`` / ``D`` / group)
===================  =================  ======================================================================

Each suite's module documents its flags; a flag left ``None`` is read from the object under test (``can_demote``
and ``can_attend`` from the store's declared capabilities, ``can_attend`` through :func:`kvcore.attends`;
``tiered`` and ``tiers`` from a selector's :class:`kvcore.TierShares` through :func:`kvcore.tier_shares`). A test
of a feature a flag turns off is skipped with the flag in the reason. Every standard test's docstring ends with a
"Troubleshooting" paragraph: what a failure usually means and how to fix it. Every suite runs
``test_no_overrides_DO_NOT_OVERRIDE``: overriding or deleting a standard test fails unless the override carries
``@pytest.mark.xfail(reason=...)`` (see :func:`overridden_standard_tests`). Properties are checked with hypothesis
(:mod:`kvcore.testing.strategies`), few examples and no deadline, so a suite runs in seconds on CPU. Needs
``pip install kvcore[testing]`` (pytest, hypothesis); ``import kvcore`` alone never imports them.
"""

try:
    import hypothesis  # noqa: F401
    import pytest  # noqa: F401
except ImportError as e:  # tested in a subprocess (test_testing_import.py)
    raise ImportError(
        f"kvcore.testing needs pytest and hypothesis ({e.name} is missing): pip install 'kvcore[testing]'"
    ) from e

from kvcore.testing.base import StandardTests, forall, overridden_standard_tests, reachable_bytes, reachable_tensors
from kvcore.testing.compressor import CompressorTests
from kvcore.testing.quantizer import QuantizerTests, pack_codes, unpack_codes
from kvcore.testing.scorer import ScorerTests
from kvcore.testing.selector import SelectorTests
from kvcore.testing.store import StoreTests

__all__ = [
    "CompressorTests",
    "QuantizerTests",
    "ScorerTests",
    "SelectorTests",
    "StandardTests",
    "StoreTests",
    "forall",
    "overridden_standard_tests",
    "pack_codes",
    "reachable_bytes",
    "reachable_tensors",
    "unpack_codes",
]
