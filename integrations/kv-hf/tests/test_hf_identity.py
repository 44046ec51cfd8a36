"""Ratio 0 through the compressed path gives the unmodified model's logits."""

import pytest
import torch
from kvhf_testkit import FAMILIES, full_compressor, prompt, tiny_model
from transformers import DynamicCache

import kv_hf


def _decode_pair(model, ids, cache_a, cache_b, steps, attention_mask=None):
    """Prefill then greedy-decode ``steps`` tokens with two caches fed the same tokens; returns logits pairs."""
    pairs = []
    kw = {}
    if attention_mask is not None:  # true positions of left-padded rows, as generate() derives them
        kw = {"attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(-1) - 1).clamp_min(0)}
    a = model(ids, past_key_values=cache_a, **kw)
    b = model(ids, past_key_values=cache_b, **kw)
    pairs.append((a.logits, b.logits))
    mask = attention_mask
    for _ in range(steps):
        tok = a.logits[:, -1:].argmax(-1)
        kw = {}
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(tok)], 1)
            pos = (mask.cumsum(-1) - 1)[:, -1:]
            kw = {"attention_mask": mask, "position_ids": pos}
        a = model(tok, past_key_values=cache_a, **kw)
        b = model(tok, past_key_values=cache_b, **kw)
        pairs.append((a.logits, b.logits))
    return pairs


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_ratio0_logits_bitwise_equal_prefill_and_decode(family, attn):
    model = tiny_model(family, attn)
    ids = prompt(13)
    ref = DynamicCache(config=model.config)
    cache = kv_hf.compressed_cache(model, full_compressor())
    assert model.config._attn_implementation == ("kv_hf" if attn == "sdpa" else "kv_hf_eager")
    for got_ref, got in _decode_pair(model, ids, ref, cache, steps=5):
        assert torch.equal(got_ref, got)
    assert cache.get_seq_length() == ref.get_seq_length() == 13 + 5
    for layer in cache.compressed:
        view, ref_layer = layer.store.read(), ref.layers[layer.layer_idx]
        assert torch.equal(view.keys, ref_layer.keys) and torch.equal(view.values, ref_layer.values)
        assert torch.equal(view.positions[0, 0], torch.arange(18))
    for window in cache.windows:  # a hybrid model's sliding layers hold what transformers' own layers hold
        ref_layer = ref.layers[window.layer_idx]
        assert torch.equal(window.keys, ref_layer.keys) and torch.equal(window.values, ref_layer.values)
        assert window.keys.shape[-2] == model.config.sliding_window - 1


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_ratio0_generate_equals_dynamic_cache(family):
    model = tiny_model(family)
    ids = prompt(9, seed=4)
    ref = model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=DynamicCache(config=model.config))
    got = model.generate(
        ids, max_new_tokens=10, do_sample=False, past_key_values=kv_hf.compressed_cache(model, full_compressor())
    )
    assert torch.equal(ref, got)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_ratio0_batch_with_left_padding_matches_dynamic_cache(attn):
    model = tiny_model("qwen3", attn)
    ids = prompt(11, B=3, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    ids = ids.masked_fill(mask == 0, 0)
    pairs = _decode_pair(
        model, ids, DynamicCache(config=model.config), kv_hf.compressed_cache(model, full_compressor()), 5, mask
    )
    prefill_ref, prefill_got = pairs[0]
    real = mask.bool()
    assert torch.equal(prefill_ref[real], prefill_got[real])  # the identical call on the prompt
    for ref, got in pairs[1:]:
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    ref = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, past_key_values=DynamicCache(config=model.config)
    )
    got = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        past_key_values=kv_hf.compressed_cache(model, full_compressor()),
    )
    assert torch.equal(ref, got)


@torch.no_grad()
def test_kv_hf_attention_is_transparent_for_other_caches():
    model = tiny_model("llama")
    ids = prompt(10)
    before = model(ids, past_key_values=DynamicCache(config=model.config)).logits
    kv_hf.enable_attention(model)
    after = model(ids, past_key_values=DynamicCache(config=model.config)).logits
    assert torch.equal(before, after)
    assert kv_hf.disable_attention(model) == "sdpa"
