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


def test_fused_attention_over_every_tier_pair():
    """attend() = softmax(q·K̂ᵀ/√d)·V̂ over the dequantized view, with every (key tier, value tier) pair present,
    values evicted under kept keys (V = 0), GQA and fp16 data."""
    from kvcore import EVICT, Plan, reference_attention

    g = torch.Generator().manual_seed(0)
    B, H, T, D, G = 2, 2, 96, 32, 8
    tiers = torch.tensor([16, 4, 2, 1], dtype=torch.uint8)
    kb = tiers[torch.randint(4, (B, H, T // G), generator=g)].repeat_interleave(G, -1)
    vb = torch.cat([tiers, torch.tensor([EVICT], dtype=torch.uint8)])[torch.randint(5, (B, H, T // G), generator=g)]
    vb = vb.repeat_interleave(G, -1)
    kb[..., :G] = EVICT
    for dtype in (torch.float32, torch.float16):
        store = HqeKVStore(block=G)
        k, v = torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, H, T, D, generator=g).to(dtype)
        store.write(k, v, Plan(kb, vb), torch.arange(T).expand(B, T))
        q = torch.randn(B, 2 * H, 1, D, generator=g).to(dtype)
        out, lse = store.attend(q)
        ref_out, ref_lse = reference_attention(store.read(), q)
        assert torch.allclose(out, ref_out, atol=2e-3, rtol=1e-3) and torch.allclose(lse, ref_lse, atol=1e-3)
        view = store.read()
        evicted_v = (vb != EVICT) | (kb == EVICT)
        assert view.keys.shape[2] == T - G and bool((view.values[~evicted_v[..., G:]] == 0).all())
