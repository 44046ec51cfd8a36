"""True positions after eviction: the cache length is not a token position (a known pitfall of eviction in
transformers caches)."""

import pytest
import torch
from kvhf_testkit import KnormScorer, make, prompt, tiny_model
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import kv_hf
from kvcore import Budget, Compressor, DenseStore, Scores, TopKSelector


class ReverseScorer:
    """Keeps everything (ratio 0) but scores later tokens higher, so the selection runs the real top-k path."""

    needs_queries = False
    needs_values = False
    needs_extras = frozenset()
    query_window = None
    chunkable = False

    def score(self, ctx):
        return Scores(ctx.positions.float()[:, None, :].expand(ctx.keys.shape[:3]).contiguous())


@torch.no_grad()
def test_keep_everything_through_compressed_path_generates_like_dynamic_cache():
    model = tiny_model("mistral")
    ids = prompt(15, seed=7)
    keep_all = Compressor(ReverseScorer(), TopKSelector(), DenseStore, Budget(ratio=0.0))
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache(config=model.config))
    got = model.generate(
        ids, max_new_tokens=12, do_sample=False, past_key_values=kv_hf.compressed_cache(model, keep_all)
    )
    assert torch.equal(ref, got)


@torch.no_grad()
def test_positions_after_eviction_are_true_positions():
    model = tiny_model("qwen3")
    ids = prompt(20, seed=8)
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.6))
    out = model.generate(ids, max_new_tokens=7, do_sample=False, past_key_values=cache)
    n_fed = 20 + 6  # generate does not feed back the last token
    assert cache.get_seq_length() == n_fed
    assert int(cache.next_positions()[0]) == n_fed
    kept = Budget(ratio=0.6).kept(20)
    for layer in cache.layers:
        view = layer.store.read()
        pos = view.positions[0]  # [H, T]
        assert view.keys.shape[2] == kept + 6  # entries held, not tokens seen
        assert layer.get_mask_sizes(1) == (kept + 6 + 1, n_fed - kept - 6)
        for h in range(pos.shape[0]):
            prefill, decoded = pos[h, :kept], pos[h, kept:]
            assert bool((prefill < 20).all()) and bool((prefill.diff() > 0).all())
            assert decoded.tolist() == list(range(20, n_fed))  # each new token got position = tokens seen
        # entries are the model's keys at those true positions: the exact prefill keys in every layer; the
        # decoded tokens' keys in layer 0 (later layers' depend on the compressed attention)
        ref = DynamicCache(config=model.config)
        model(out[:, :n_fed], past_key_values=ref)
        full_keys = ref.layers[layer.layer_idx].keys[0]
        upto = view.keys.shape[2] if layer.layer_idx == 0 else kept
        for h in range(pos.shape[0]):
            torch.testing.assert_close(view.keys[0, h, :upto], full_keys[h, pos[h, :upto]], rtol=0, atol=1e-5)


_EVICTED: dict[int, torch.Tensor] = {}


def _masked_attention(module, query, key, value, attention_mask, **kwargs):
    """Reference: full DynamicCache attention with the per-head evicted prefill entries masked out."""
    evicted = _EVICTED[module.layer_idx]  # [B, H, T0]
    B, Hq, q, _ = query.shape
    kv = key.shape[2]
    bias = torch.zeros(B, key.shape[1], kv)
    if kv > evicted.shape[2]:  # after the prefill: the prompt's evicted entries are invisible
        bias[:, :, : evicted.shape[2]] = bias[:, :, : evicted.shape[2]].masked_fill(evicted, float("-inf"))
    bias = bias.repeat_interleave(Hq // key.shape[1], 1)[:, :, None, :].expand(B, Hq, q, kv)
    if attention_mask is not None:
        bias = bias.masked_fill(~attention_mask, float("-inf"))
    elif q > 1:
        causal = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)
        bias = bias.masked_fill(~causal, float("-inf"))
    return sdpa_attention_forward(module, query, key, value, bias, **kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@torch.no_grad()
def test_decoding_after_per_head_eviction_matches_masked_full_attention(family):
    """Compressed decode == full-cache decode where each head ignores exactly the entries its Store evicted."""
    AttentionInterface.register("kvhf_test_masked", _masked_attention)
    AttentionMaskInterface.register("kvhf_test_masked", sdpa_mask)
    model = tiny_model(family)
    ids = prompt(24, seed=9)
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    logits = [model(ids, past_key_values=cache).logits[:, -1]]
    for layer in cache.layers:
        pos = layer.store.read().positions  # [B, H, kept]
        held = torch.zeros(1, pos.shape[1], 24, dtype=torch.bool).scatter_(2, pos, True)
        _EVICTED[layer.layer_idx] = ~held
    assert any(bool((~(_EVICTED[i][:, 0] == _EVICTED[i][:, 1])).any()) for i in _EVICTED)  # ragged per head
    tokens = [logits[0].argmax(-1, keepdim=True)]
    for _ in range(4):
        logits.append(model(tokens[-1], past_key_values=cache).logits[:, -1])
        tokens.append(logits[-1].argmax(-1, keepdim=True))

    ref_model = tiny_model(family)
    ref_model.set_attn_implementation("kvhf_test_masked")
    ref = DynamicCache(config=ref_model.config)
    ref_logits = [ref_model(ids, past_key_values=ref).logits[:, -1]]
    for tok in tokens[:-1]:
        ref_logits.append(ref_model(tok, past_key_values=ref).logits[:, -1])
    # prefill logits are exact (attention over the whole prompt), decode logits follow the evicted cache
    for got, want in zip(logits, ref_logits):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # and they differ from the unmasked model, so the test can tell eviction apart from no eviction
    plain = tiny_model(family)
    plain_cache = DynamicCache(config=plain.config)
    plain(ids, past_key_values=plain_cache)
    assert not torch.allclose(plain(tokens[0], past_key_values=plain_cache).logits[:, -1], logits[1], atol=1e-4)
