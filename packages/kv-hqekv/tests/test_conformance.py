"""Every object kv-hqekv's registered methods are made of goes through its kvcore conformance suite.

The scorer, selector, quantizers and store are built small (windows and blocks of 4, blocks of one token for the
selector) so the suites' short layers reach every tier; the compressors are the registered methods themselves (the
paper's presets and the Table 6 ablations), built through :mod:`kvcore.registry`, and HqeKV with blocks of 4 so the
suite's layers are quantized. Each suite class names the objects it builds in ``cases``; the coverage test at the end
compares them with what the registered methods use. The 4- and 2-bit tiers are kvcodec's ``UniformQuantizer`` at
HqeKV's groupings (run here too).
"""

import pytest
import torch

from kv_hqekv import (
    HqeKVConfig,
    HqeKVScorer,
    HqeKVSelector,
    HqeKVStore,
    NormalizedQuantizer,
    Shares,
    UniformOneBitQuantizer,
    hqekv,
    tier_quantizer,
)
from kv_hqekv.registry import METHODS
from kvcore import Compressor, registry
from kvcore.testing import CompressorTests
from kvcore.testing.cases import (
    QuantizerCases,
    RegisteredMethods,
    ScorerCases,
    SelectorCases,
    StoreCases,
    methods_run,
    objects,
    parametrize_cases,
)


class ScorerSuite(ScorerCases):
    """This package's scorer cases (the coverage test reads its subclasses)."""


class SelectorSuite(SelectorCases):
    """This package's selector cases."""


class QuantizerSuite(QuantizerCases):
    """This package's quantizer cases."""


class StoreSuite(StoreCases):
    """This package's store cases."""


class RegisteredSuite(RegisteredMethods):
    """The registered methods ``methods`` (names), each built by the registry at its default budget."""


pytest_generate_tests = parametrize_cases


# -- scorer -----------------------------------------------------------------------------------------------------
class TestHqeKVScorer(ScorerSuite):
    cases = objects(
        joint=lambda: HqeKVScorer(window=4, times_range=True),
        keys_only=lambda: HqeKVScorer(window=4, times_range=False),  # the "no-range" ablation's
    )


# -- selector ---------------------------------------------------------------------------------------------------
SHARES = Shares(0.3, 0.4, 0.2, 0.1)  # 2.2 average bits


class TestHqeKVSelectorPerHead(SelectorSuite):
    """Blocks of one token ranked per head: the configuration where the suite's per-head properties apply."""

    tiered = True
    avg_bits_choices = (SHARES.avg_bits,)
    cases = objects(per_head=lambda: HqeKVSelector(SHARES, block=1, fp16_blocks=1, sharing="head"))

    def expected_shares(self, selector, budget):
        return None  # counts follow the rounding repair on the non-fp16 blocks (test_selector.py)

    @pytest.mark.xfail(
        reason="HqeKV keeps its most important blocks in fp16 on top of the Eq. 3 code bits and rounds counts to "
        "nearest (the authors' make_sum_equal), so avg_bits is not met from below; see "
        "test_shares.py::test_achieved_bits_within_rounding_bound",
        strict=True,
    )
    def test_average_bits_budget(self, selector) -> None:
        super().test_average_bits_budget(selector)


# -- quantizers -------------------------------------------------------------------------------------------------
class TestUniformTiers(QuantizerSuite):
    """The 4- and 2-bit tiers with the paper's groupings (keys per channel, values per token, G = 32)."""

    cases = objects(
        **{f"{b}bit_{k}": (lambda b=b, k=k: tier_quantizer(b, k, 32)) for b in (4, 2) for k in ("key", "value")}
    )


class TestNormalizedQuantizer(QuantizerSuite):
    """The normalized 1-bit tier."""

    uniform = False
    cases = objects(
        channel_g32=lambda: NormalizedQuantizer(1, "channel", 32),
        token_g32=lambda: NormalizedQuantizer(1, "token", 32),
        token_g4=lambda: NormalizedQuantizer(1, "token", 4),
    )


class TestUniformOneBitQuantizer(QuantizerSuite):
    """Table 6's "w/o II" 1-bit tier: uniform min-max held in the normalized form (codebook ``±c``)."""

    uniform = False
    cases = objects(
        channel_g32=lambda: UniformOneBitQuantizer(1, "channel", 32),
        token_g32=lambda: UniformOneBitQuantizer(1, "token", 32),
        token_g4=lambda: UniformOneBitQuantizer(1, "token", 4),
    )


# -- store ------------------------------------------------------------------------------------------------------
class TestHqeKVStore(StoreSuite):
    """Blocks of 4: the suite's short heads complete key groups. ``uniform`` is the Table 6 "w/o II" store (uniform
    min-max 1-bit tier): the same contract; its 1-bit error is at most the group range, below the bound here."""

    cases = objects(
        normalized=lambda: HqeKVStore(block=4),
        uniform=lambda: HqeKVStore(block=4, one_bit="uniform"),
    )

    def max_quantization_error(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        """Uniform tiers: the suite's min-max bound. The normalized 1-bit tier reconstructs ``mean ± 0.674·std``:
        with ``|x - mean| <= range`` and the unbiased std of a group within ``range``, the error is at most the wider
        range of the entry's groups."""
        if bits != 1:
            return super().max_quantization_error(x, bits)
        x = x.float()
        ch, tok = x.max(0).values - x.min(0).values, x.max(1).values - x.min(1).values
        return torch.maximum(ch[None, :], tok[:, None]) * 1.01


# -- compressors ------------------------------------------------------------------------------------------------
class TestHqeKVSmallBlocks(CompressorTests):
    """HqeKV with blocks and a window of 4, so the suite's layers (16 to 48 tokens) hold every tier."""

    lossless_at_zero_ratio = False  # quantizes by its shares whatever the ratio
    evicts = False  # budgeted by avg_bits

    @pytest.fixture(params=[2.0, 3.2], ids=["hqekv-2", "hqekv-3.2"])
    def compressor(self, request):
        return hqekv(request.param, config=HqeKVConfig(block=4, window=4))


class TestRegisteredMethods(RegisteredSuite):
    """Every registered preset and ablation as the registry builds it (blocks of 32, window 20)."""

    lossless_at_zero_ratio = False
    evicts = False
    methods = tuple(m.name for m in METHODS)


# -- coverage ---------------------------------------------------------------------------------------------------
SUITES = {"scorer": ScorerSuite, "selector": SelectorSuite, "store": StoreSuite, "quantizer": QuantizerSuite}


def parts(c: Compressor) -> set[tuple[str, type]]:
    store = c.new_store()
    quantizers = {("quantizer", type(q)) for side in getattr(store, "quantizers", {}).values() for q in side.values()}
    return {("scorer", type(c.scorer)), ("selector", type(c.selector)), ("store", type(store))} | quantizers


def test_suites_cover_every_registered_method():
    """Every method kv-hqekv registers goes through ``CompressorTests`` here, and every scorer / selector / store /
    tier quantizer class those methods are made of goes through its suite here (kvcodec's ``UniformQuantizer`` too).
    ``TestRegisteredMethods`` takes its names from the package's ``METHODS``, so a new method enters it by
    registering; discover() must find them all."""
    ours = {m.name for m in METHODS}
    found = {name: m for name, m in registry.discover().items() if name in ours}
    assert set(found) == ours, f"not discovered: {sorted(ours - set(found))}"
    tested = methods_run([RegisteredSuite])
    assert tested == ours, f"registered methods without CompressorTests: {sorted(ours - tested)}"
    used = set().union(*(parts(m.build()) for m in found.values()))
    suites = [(part, cls) for part, suite in SUITES.items() for cls in suite.__subclasses__()]
    covered = {(part, type(make())) for part, cls in suites for make in cls.cases.values()}
    assert used <= covered, f"classes of registered methods no suite runs on: {sorted(used - covered, key=str)}"
