"""The kvcore conformance suites, adopted for UniformQuantizer (every width x axis) and KIVIStore."""

import pytest
from kvcore.testing import QuantizerTests, StoreTests

from kv_baselines.quant import QUANT_BITS, KIVIStore, UniformQuantizer

QUANTIZERS = [(bits, axis, G) for bits in QUANT_BITS for axis in ("token", "channel") for G in (8,)] + [
    (2, "channel", 32), (4, "token", 3),  # KIVI's group size, and a group size that is not a power of two
]


class TestUniformQuantizer(QuantizerTests):
    @pytest.fixture(params=QUANTIZERS, ids=lambda p: f"{p[0]}bit-{p[1]}-G{p[2]}")
    def quantizer(self, request):
        bits, axis, G = request.param
        return UniformQuantizer(bits, axis, G)


class TestKIVIStore(StoreTests):
    """KIVI-2 with a short residual, so the suite's appends exercise both residual policies."""

    # KIVI's policy quantizes on append (a full key block; the value leaving the FIFO), so appended or earlier
    # entries are not bit-exact after an append; positions and the other checks still apply.
    lossless_append = False

    @pytest.fixture
    def store_factory(self):
        return lambda: KIVIStore(UniformQuantizer(2, "channel", 4), UniformQuantizer(2, "token", 4), residual=8)


class TestKIVIStoreLongResidual(StoreTests):
    """KIVI-4 with the paper's residual: the suite's short sequences never leave the residual, so appended
    entries must read back bit-exact and earlier ones unchanged."""

    @pytest.fixture
    def store_factory(self):
        return lambda: KIVIStore(UniformQuantizer(4, "channel", 32), UniformQuantizer(4, "token", 4), residual=128)
