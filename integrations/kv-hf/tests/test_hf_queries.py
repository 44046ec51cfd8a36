"""Query capture: scorers get the prefill's last-W post-RoPE query states, all query heads ([B, Hq, W, D])."""

import kv_hf
import pytest
import torch
from kvhf_testkit import Recording, WindowScorer, make, naive_qk, prompt, tiny_model


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
@torch.no_grad()
def test_prefill_window_queries_are_the_models_post_rope_queries(family):
    model = tiny_model(family)
    rec = Recording(WindowScorer())
    cache = kv_hf.compressed_cache(model, make(rec, ratio=0.5), query_window=5)
    ids = prompt(17, seed=60)
    model(ids, past_key_values=cache)
    assert [c.layer_idx for c in rec.contexts] == [0, 1]
    for ctx in rec.contexts:
        q, k = naive_qk(model, ids, ctx.layer_idx)
        assert tuple(ctx.queries.shape) == (1, 4, 5, 16)
        torch.testing.assert_close(ctx.queries, q[:, :, -5:], rtol=0, atol=1e-5)
        torch.testing.assert_close(ctx.keys, k, rtol=0, atol=1e-5)  # KV-head granular, never repeat_kv'd
        assert ctx.positions.tolist() == [list(range(17))]


@torch.no_grad()
def test_chunked_prefill_window_spans_chunks_and_padding_is_masked():
    model = tiny_model("llama")
    rec = Recording(WindowScorer())
    cache = kv_hf.compressed_cache(model, make(rec, ratio=0.5), query_window=6)
    ids = prompt(14, B=2, seed=61)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    kv_hf.prefill(model, cache, ids, mask, chunk_size=4)  # last chunk has 2 tokens: the window spans 2 chunks
    ctx = rec.contexts[0]
    assert tuple(ctx.queries.shape) == (2, 4, 6, 16)
    # entries are laid out by true position, padding last (masked, zeroed: never NaN)
    assert ctx.attention_mask[1].tolist() == [True] * 9 + [False] * 5
    assert ctx.positions[0].tolist() == list(range(14)) and ctx.positions[1, :9].tolist() == list(range(9))
    assert bool((ctx.keys[1, :, 9:] == 0).all()) and bool(torch.isfinite(ctx.keys).all())
    _, k1 = naive_qk(model, ids[1:, 5:], 0)
    torch.testing.assert_close(ctx.keys[1:, :, :9], k1, rtol=0, atol=1e-5)
    q0, _ = naive_qk(model, ids[:1], 0)
    torch.testing.assert_close(ctx.queries[:1], q0[:, :, -6:], rtol=0, atol=1e-5)
    q1, _ = naive_qk(model, ids[1:, 5:], 0)
    torch.testing.assert_close(ctx.queries[1:], q1[:, :, -6:], rtol=0, atol=1e-5)
