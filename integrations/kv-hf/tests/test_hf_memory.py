"""Eviction frees real bytes: cache.nbytes() is what the Stores hold."""

import torch
from kvhf_testkit import KnormScorer, full_compressor, make, prompt, tiny_model
from transformers import DynamicCache

import kv_hf
from kvcore import storage_bytes


def _held(store) -> int:
    """Bytes of every tensor the store object holds, counted by storage (independent of Store.nbytes)."""
    return storage_bytes([v for v in vars(store).values() if isinstance(v, torch.Tensor)])


@torch.no_grad()
def test_nbytes_halves_at_ratio_half_and_matches_store_storage():
    model = tiny_model("llama")
    ids = prompt(64)
    full = kv_hf.compressed_cache(model, full_compressor())
    half = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    model(ids, past_key_values=full)
    model(ids, past_key_values=half)
    for cache in (full, half):
        assert (
            cache.nbytes()
            == sum(_held(layer.store) for layer in cache.layers)
            == sum(layer.store.nbytes() for layer in cache.layers)
        )
        assert cache.nbytes("cpu") == cache.nbytes() and cache.nbytes("meta") == 0
    assert all(int(n.max()) == 32 and int(n.min()) == 32 for n in half.seq_lengths())
    # K/V bytes of ratio 0 equal the unmodified cache's; the positions (int32) and per-head lengths are overhead
    ref = DynamicCache(config=model.config)
    model(ids, past_key_values=ref)
    kv_ref = sum(storage_bytes([layer.keys, layer.values]) for layer in ref.layers)
    assert kv_ref < full.nbytes() <= kv_ref * 1.1
    assert abs(half.nbytes() / full.nbytes() - 0.5) < 0.01


@torch.no_grad()
def test_prefill_pending_bytes_are_counted_until_compressed():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.75))
    cache.collect()
    model(prompt(40), past_key_values=cache)
    raw = cache.nbytes()
    assert raw == sum(storage_bytes(layer.pending.tensors()) for layer in cache.layers)
    cache.compress()
    assert all(layer.pending is None for layer in cache.layers)
    assert cache.nbytes() < raw * 0.35
