"""The kvcore Quantizer conformance suite, adopted for UniformQuantizer (every width x axis) and CodebookQuantizer."""

import pytest

from kvcodec import QUANT_BITS, CodebookQuantizer, UniformQuantizer
from kvcore.testing import QuantizerTests

QUANTIZERS = [(bits, axis, G) for bits in QUANT_BITS for axis in ("token", "channel") for G in (8,)] + [
    (2, "channel", 32),
    (4, "token", 3),  # KIVI's group size, and a group size that is not a power of two
]


class TestUniformQuantizer(QuantizerTests):
    @pytest.fixture(params=QUANTIZERS, ids=lambda p: f"{p[0]}bit-{p[1]}-G{p[2]}")
    def quantizer(self, request):
        bits, axis, G = request.param
        return UniformQuantizer(bits, axis, G)


class TestCodebookQuantizer(QuantizerTests):
    @pytest.fixture(
        params=[(2, "token", 8), (3, "channel", 4), (4, "token", 3)], ids=lambda p: f"{p[0]}bit-{p[1]}-G{p[2]}"
    )
    def quantizer(self, request):
        bits, axis, G = request.param
        return CodebookQuantizer(bits, axis, G)
