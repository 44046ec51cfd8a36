"""kv-hex through the HF adapter: HEX-3 on a tiny random Llama, prefill then decode through ``HEXStore.attend``."""

import pytest
import torch

kv_hf = pytest.importorskip("kv_hf")
kv_hex = pytest.importorskip("kv_hex")
from kv_hf.testing import tiny_model


@torch.no_grad()
def test_hex_prefill_and_decode_through_kv_hf():
    """Blocks of 8 so decoding crosses block ends: every token is held (HEX evicts nothing), the residual stays
    below the block, bytes fall below the fp16 cache's, and logits stay close to the full cache's."""
    model = tiny_model()
    comp = kv_hex.hex(3, block_size=8, rho=0.125)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (1, 30), generator=g)
    cache = kv_hf.compressed_cache(model, comp)
    logits = kv_hf.prefill(model, cache, ids)
    full = model(ids).logits[:, -1]
    assert torch.isfinite(logits).all()
    assert torch.nn.functional.cosine_similarity(logits, full).item() > 0.9
    steps = 12
    for _ in range(steps):
        nxt = logits.argmax(-1, keepdim=True)
        logits = model(nxt, past_key_values=cache).logits[:, -1]
        assert torch.isfinite(logits).all()
    for layer in cache.layers:
        store = layer.store
        assert isinstance(store, kv_hex.HEXStore)
        assert store.seq_lengths().tolist() == [[30 + steps] * 2], "every token held: HEX evicts nothing"
        assert bool((store.residual_lengths() < 8).all())
        assert len(store._segments) >= 2, "decode filled at least one block"
    dense = 2 * 2 * (30 + steps) * 2 * 16 * 4  # layers * K/V * tokens * heads * dims * fp32 bytes
    assert cache.nbytes() < dense
