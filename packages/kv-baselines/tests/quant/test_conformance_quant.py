"""The kvcore Store conformance suite, adopted for KIVIStore."""

import pytest

from kv_baselines.quant import KIVIStore, UniformQuantizer
from kvcore.testing import StoreTests


# the generic suite writes eviction-only (all FULL) plans into KIVIStore on purpose
@pytest.mark.filterwarnings("ignore::kv_baselines.quant.KIVIUnquantizedWarning")
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
