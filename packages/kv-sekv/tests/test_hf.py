"""SEKV through the transformers adapter on a tiny random Llama: the ``surprisal`` provider equals the full
log-softmax of the model's own logits, and prefill + decode run with SEKV's store."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
kv_hf = pytest.importorskip("kv_hf")

from sekv_testkit import router

from kv_hf.testing import tiny_model
from kv_sekv import SEKVConfig, SEKVStore, sekv, surprisal_from_logits


def _model():
    return tiny_model()


def test_prefill_provides_surprisal_and_decodes():
    model = _model()
    config = SEKVConfig(window=8, min_span=4, max_rank=8, proj_dim=8, zoom_share=0.5)
    comp = sekv(0.5, router(L=2, Hq=4, Hkv=2, D=16, config=config, gate_bias=4.0), config)
    seen = {}
    scorer_score = comp.scorer.score

    def spy(ctx):
        seen[ctx.layer_idx] = ctx.extras["surprisal"].clone()
        return scorer_score(ctx)

    object.__setattr__(comp.scorer, "score", spy)
    cache = kv_hf.compressed_cache(model, comp)
    ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(1))
    logits = kv_hf.prefill(model, cache, ids, chunk_size=50)
    with torch.no_grad():
        full = model(ids).logits
    want = surprisal_from_logits(full, ids)
    assert set(seen) == {0, 1}
    torch.testing.assert_close(seen[0], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, full[:, -1], rtol=1e-4, atol=1e-4)
    store = cache.layers[0].store
    assert isinstance(store, SEKVStore) and store._spans is not None
    assert 0 < store.used[0] <= 0.5
    assert cache.nbytes() < 2 * 2 * 2 * 120 * 16 * 4  # below the full cache of 2 layers
    nxt = logits.argmax(-1, keepdim=True)
    for _ in range(3):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        assert torch.isfinite(out.logits).all()
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    assert int(cache.layers[0].store.seq_lengths()[0, 0]) > 3
