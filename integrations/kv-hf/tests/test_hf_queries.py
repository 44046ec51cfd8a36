"""Query capture: scorers get the prefill's last-W post-RoPE query states, all query heads ([B, Hq, W, D])."""

from dataclasses import dataclass

import pytest
import torch
from kvhf_testkit import Recording, WindowScorer, make, naive_qk, prompt, tiny_model

import kv_baselines
import kv_hf
from kv_hf.support import DEFAULT_QUERY_WINDOW
from kvcore import ScoringContext


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
    # entries are laid out in slot order (extras stay aligned), left padding first (masked, zeroed: never NaN)
    assert ctx.attention_mask[1].tolist() == [False] * 5 + [True] * 9
    assert ctx.positions[0].tolist() == list(range(14)) and ctx.positions[1, 5:].tolist() == list(range(9))
    assert bool((ctx.keys[1, :, :5] == 0).all()) and bool(torch.isfinite(ctx.keys).all())
    _, k1 = naive_qk(model, ids[1:, 5:], 0)
    torch.testing.assert_close(ctx.keys[1:, :, 5:], k1, rtol=0, atol=1e-5)
    q0, _ = naive_qk(model, ids[:1], 0)
    torch.testing.assert_close(ctx.queries[:1], q0[:, :, -6:], rtol=0, atol=1e-5)
    q1, _ = naive_qk(model, ids[1:, 5:], 0)
    torch.testing.assert_close(ctx.queries[1:], q1[:, :, -6:], rtol=0, atol=1e-5)


@dataclass(frozen=True)
class AskingScorer(WindowScorer):
    """A scorer that states how many trailing queries it needs (``None``: every prompt query, like H2O)."""

    query_window: int | None = 12


@pytest.mark.parametrize("asked", [12, None])
@torch.no_grad()
def test_the_scorers_declared_window_is_what_it_gets(asked):
    model = tiny_model("llama")
    rec = Recording(AskingScorer(query_window=asked))
    cache = kv_hf.compressed_cache(model, make(rec, ratio=0.5))
    assert cache.query_window == asked
    ids = prompt(90, seed=62)
    model(ids, past_key_values=cache)
    q, _ = naive_qk(model, ids, 0)
    want = 90 if asked is None else asked
    torch.testing.assert_close(rec.contexts[0].queries, q[:, :, -want:], rtol=0, atol=1e-5)
    # every prompt query was for the prefill: afterwards only a bounded recent window is held
    assert cache.layers[0].queries.shape[2] == (DEFAULT_QUERY_WINDOW if asked is None else asked)


@torch.no_grad()
def test_h2o_accumulates_over_every_prompt_query_through_the_adapter():
    model = tiny_model("llama")
    ids = prompt(90, seed=63)  # longer than the default 64-query window
    rec = Recording(kv_baselines.H2OScorer())
    cache = kv_hf.compressed_cache(model, make(rec, ratio=0.5))
    model(ids, past_key_values=cache)
    q, k = naive_qk(model, ids, 1)
    ref = kv_baselines.H2OScorer().score(ScoringContext(k, k, queries=q)).keys
    torch.testing.assert_close(rec.inner.score(rec.contexts[1]).keys, ref, rtol=1e-5, atol=1e-6)
    # each of the 90 queries spreads one unit of attention per query head: the sum is 90 per KV head
    torch.testing.assert_close(ref.sum(-1), torch.full_like(ref.sum(-1), 90.0), rtol=1e-5, atol=1e-4)


def test_an_explicit_window_shorter_than_the_scorers_is_refused():
    model = tiny_model("llama")
    rec = Recording(AskingScorer(query_window=12))
    with pytest.raises(ValueError, match="asks for its last 12 queries but query_window=5"):
        kv_hf.compressed_cache(model, make(rec), query_window=5)
    assert kv_hf.compressed_cache(model, make(rec), query_window=20).query_window == 20
    assert kv_hf.compressed_cache(model, make(Recording(WindowScorer()))).query_window is None  # every prompt query
