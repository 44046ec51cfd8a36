"""KVzip through the adapter: reconstruction-pass scores vs a naive eager computation (KVzip score.py)."""

import math

import pytest
import torch
from kvhf_testkit import CharTokenizer, Recording, prompt, tiny_model

import kv_baselines
import kv_hf
from kvcore import Budget

PREFIX, CTX = 3, 25
CONFIG = kv_hf.KVzipConfig(chunk_size=10, prev_tokens=3)


def _naive_scores(model, input_ids, tok, layer_idx):
    """For every context key: max over GQA group and reconstruction queries of softmax([sink|chunk|repeat])."""
    from kvhf_testkit import naive_qk

    T = input_ids.shape[1]
    H = model.config.num_key_value_heads
    g = model.config.num_attention_heads // H
    out = torch.zeros(H, T)
    out[:, :PREFIX] = 1.0
    encode = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    for start, end, rep in CONFIG.requests(input_ids[:, PREFIX:], encode):
        q, k = naive_qk(model, torch.cat([input_ids, rep], 1), layer_idx)
        Q = rep.shape[1]
        for h in range(H):
            keys = torch.cat([k[0, h, :PREFIX], k[0, h, PREFIX + start : PREFIX + end], k[0, h, T:]])
            nc = end - start
            for j in range(g):
                for i in range(Q):
                    logits = q[0, h * g + j, T + i] @ keys[: PREFIX + nc + i + 1].T / math.sqrt(q.shape[-1])
                    attn = torch.softmax(logits, -1)[PREFIX : PREFIX + nc]
                    seg = out[h, PREFIX + start : PREFIX + end]
                    out[h, PREFIX + start : PREFIX + end] = torch.maximum(seg, attn)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_kvzip_scores_match_naive_max_over_group_and_queries(family):
    model = tiny_model(family)
    tok = CharTokenizer()
    ids = prompt(PREFIX + CTX, seed=50)
    rec = Recording(kv_baselines.KVzipScorer())
    comp = kv_baselines.kvzip(ratio=0.5)
    comp = type(comp)(rec, comp.selector, comp.store, comp.budget)
    cache = kv_hf.compressed_cache(model, comp)
    kv_hf.prefill(model, cache, ids, tokenizer=tok, context_start=PREFIX, kvzip=CONFIG)
    assert len(rec.contexts) == model.config.num_hidden_layers
    for ctx in rec.contexts:
        got = ctx.extras["kvzip_scores"]
        assert tuple(got.shape) == (1, 2, PREFIX + CTX)
        want = _naive_scores(model, ids, tok, ctx.layer_idx)
        torch.testing.assert_close(got[0], want, rtol=0, atol=2e-5)
        assert bool(ctx.protected[0, :PREFIX].all()) and not bool(ctx.protected[0, PREFIX:].any())
    # the reconstruction pass left nothing behind; the global budget kept L*H*kept(T) entries, prefix always
    assert cache.get_seq_length() == PREFIX + CTX
    total = sum(int(n.sum()) for n in cache.seq_lengths())
    assert total == 2 * 2 * Budget(ratio=0.5).kept(PREFIX + CTX)
    for layer in cache.layers:
        pos = layer.store.read().positions[0]
        for h in range(2):
            assert set(range(PREFIX)) <= set(pos[h].tolist())


@torch.no_grad()
def test_kvzip_needs_the_adapter_pass_and_refuses_batches():
    model = tiny_model("llama")
    tok = CharTokenizer()
    cache = kv_hf.compressed_cache(model, kv_baselines.kvzip(ratio=0.5, granularity="head"))
    with pytest.raises(ValueError, match="kvzip_scores"):
        model(prompt(12), past_key_values=cache)  # plain forward: nothing supplies the scores
    cache = kv_hf.compressed_cache(model, kv_baselines.kvzip(ratio=0.5))
    with pytest.raises(ValueError, match="tokenizer"):
        kv_hf.prefill(model, cache, prompt(12))
    with pytest.raises(ValueError, match="batch size 1"):
        kv_hf.prefill(model, cache, prompt(12, B=2), tokenizer=tok)
    with pytest.raises(ValueError, match=r"shape \(1, 2, 5\)"):
        from kvcore import ScoringContext

        kv_baselines.KVzipScorer().score(
            ScoringContext(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), extras={"kvzip_scores": torch.zeros(1, 5)})
        )


@torch.no_grad()
def test_kvzip_head_granularity_answers_from_compressed_context():
    model = tiny_model("qwen2")
    tok = CharTokenizer()
    cache = kv_hf.compressed_cache(model, kv_baselines.kvzip(ratio=0.6, granularity="head"))
    kv_hf.prefill(model, cache, prompt(30, seed=51), tokenizer=tok, kvzip=kv_hf.KVzipConfig(chunk_size=12))
    assert all(bool((n == Budget(ratio=0.6).kept(30)).all()) for n in cache.seq_lengths())
    out = kv_hf.generate_answer(model, cache, prompt(4, seed=52), max_new_tokens=3)
    assert out.shape == (1, 3) and cache.get_seq_length() == 30
