"""The HqeKV store: conformance and the decode-time properties (bits never increase, evicted never returns)."""

import pytest
import torch

from kv_hqekv import HqeKVStore
from kvcore.testing import StoreTests


class TestHqeKVStore(StoreTests):
    @pytest.fixture
    def store_factory(self):
        return lambda: HqeKVStore(block=4)  # small groups: the suite's short heads complete key groups

    def max_quantization_error(self, x: torch.Tensor, bits: int) -> torch.Tensor:
        """Uniform tiers: the suite's min-max bound. The normalized 1-bit tier reconstructs ``mean ± 0.674·std``:
        with ``|x - mean| <= range`` and the unbiased std of a group within ``range``, the error is at most the wider
        range of the entry's groups."""
        if bits != 1:
            return super().max_quantization_error(x, bits)
        x = x.float()
        ch, tok = x.max(0).values - x.min(0).values, x.max(1).values - x.min(1).values
        return torch.maximum(ch[None, :], tok[:, None]) * 1.01
