"""kv-baselines through kv-hf: the ``rope_inv_freq`` provider, Expected Attention against kvpress's recipe on a real
(tiny, random) model, and PyramidKV's layer budgets end to end."""

from __future__ import annotations

import math

import pytest
import torch

import kv_baselines as kb
from kv_baselines.scorers import ROPE_EXTRA
from kvcore import ScoringContext

kv_hf = pytest.importorskip("kv_hf")
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kv_baselines.hf import ROPE, rope_frequencies
from kv_baselines.sentence import sentence_ids
from kv_hf.testing import tiny_model


def test_provider_is_discovered_and_reads_the_rotary_embedding():
    assert kv_hf.providers.discover()[ROPE_EXTRA] is ROPE
    llama = tiny_model("llama")
    assert torch.equal(rope_frequencies(llama, 1), llama.model.rotary_emb.inv_freq.float())
    gemma = tiny_model("gemma3", num_hidden_layers=4)
    assert torch.equal(rope_frequencies(gemma, 1), gemma.model.rotary_emb.full_attention_inv_freq.float())
    assert torch.equal(rope_frequencies(gemma, 0), gemma.model.rotary_emb.sliding_attention_inv_freq.float())


def _kvpress_scores(q_pre, k, v, rotary, n_future, n_sink):
    """kvpress ``ExpectedAttentionPress.score`` from the pre-RoPE queries ``W_q h`` (its hidden-state projection)."""
    B, Hq, T, D = q_pre.shape
    H = k.shape[1]
    q = q_pre[:, :, n_sink:].double()
    mu = q.mean(2)
    c = q - mu[:, :, None]
    cov = torch.einsum("bhti,bhtj->bhij", c, c) / c.shape[2]
    cos, sin = rotary(q_pre, torch.arange(T, T + n_future)[None])
    cos, sin = cos[0].double(), sin[0].double()
    eye = torch.eye(D, dtype=torch.float64)
    P = torch.zeros(D, D, dtype=torch.float64)
    P[D // 2 :, : D // 2], P[: D // 2, D // 2 :] = torch.eye(D // 2), -torch.eye(D // 2)
    R = (cos[:, :, None] * eye + sin[:, :, None] * P).mean(0)
    mu, cov = mu @ R.T, R @ cov @ R.T
    keys = k[:, :, n_sink:].double().repeat_interleave(Hq // H, 1)
    s = torch.einsum("bhd,bhtd->bht", mu, keys) / math.sqrt(D)
    s = s + torch.einsum("bhti,bhij,bhtj->bht", keys, cov, keys) / D / 2
    s = torch.softmax(s, -1).view(B, H, Hq // H, -1).mean(2)
    s = s * v[:, :, n_sink:].double().norm(dim=-1)
    return torch.nn.functional.pad(s, (n_sink, 0), value=float(s.max()))


def test_expected_attention_equals_kvpress_recipe_on_a_model():
    """Scores from the model's post-RoPE queries (rotated back by the provider's frequencies) equal kvpress's scores
    from the pre-RoPE projections of the same hidden states."""
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    seen = {}
    hook = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(h=kw["hidden_states"]), with_kwargs=True)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        hook.remove()
        h = seen["h"]
        B, T, _ = h.shape
        q_pre = attn.q_proj(h).view(B, T, -1, 16).transpose(1, 2)
        k_pre = attn.k_proj(h).view(B, T, -1, 16).transpose(1, 2)
        v = attn.v_proj(h).view(B, T, -1, 16).transpose(1, 2)
        cos, sin = model.model.rotary_emb(h, torch.arange(T)[None])
        q, k = apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
        extras = {ROPE_EXTRA: rope_frequencies(model, 0)}
        got = kb.ExpectedAttentionScorer(n_future_positions=64).score(ScoringContext(k, v, q, extras=extras)).keys
        want = _kvpress_scores(q_pre, k, v, model.model.rotary_emb, 64, 4).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefill_runs_expected_attention_and_pyramidkv(family):
    model = tiny_model(family, num_hidden_layers=4)
    ids = torch.randint(0, 256, (1, 120), generator=torch.Generator().manual_seed(1))
    cache = kv_hf.compressed_cache(model, kb.expected_attention(0.5))
    kv_hf.prefill(model, cache, ids)
    assert all(bool(n.eq(60).all()) for n in cache.seq_lengths())
    cache = kv_hf.compressed_cache(model, kb.pyramidkv(0.5, window=8))
    kv_hf.prefill(model, cache, ids)
    lengths = [int(n[0, 0]) for n in cache.seq_lengths()]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    assert sum(lengths) == 60 * len(lengths)


class _Chars:
    """A stand-in tokenizer: id ``i`` decodes to ``"."`` every 9th id, else a word."""

    def decode(self, ids):
        return "." if ids[0] % 9 == 0 else " w"


def test_sentencekv_prefills_and_decodes_through_the_retrieving_store(monkeypatch):
    model = tiny_model("llama", num_hidden_layers=2)
    ids = torch.randint(1, 256, (1, 500), generator=torch.Generator().manual_seed(2))
    comp = kb.sentencekv(0.2)
    cache = kv_hf.compressed_cache(model, comp)
    with pytest.raises(ValueError, match="tokenizer"):
        kv_hf.prefill(model, cache, ids)
    cache = kv_hf.compressed_cache(model, comp)
    logits = kv_hf.prefill(model, cache, ids, tokenizer=_Chars())
    assert all(bool(n.eq(400).all()) for n in cache.seq_lengths())
    store = cache.compressed[0].store
    assert isinstance(store, kb.SentenceKVStore) and int(store._limit.min()) == 400 // 5 - 64
    want = sentence_ids(ids, lambda i: i % 9 == 0)
    held = store.read().positions[0, 0]
    assert torch.equal(store.sentences()[0, 0], want[0, held])
    calls = []
    retrieve = kb.SentenceKVStore.retrieve
    monkeypatch.setattr(
        kb.SentenceKVStore, "retrieve", lambda self, v, q: calls.append(q.shape) or retrieve(self, v, q)
    )
    nxt = logits.argmax(-1, keepdim=True)
    with torch.no_grad():
        out = model(nxt, past_key_values=cache, use_cache=True)
    assert torch.isfinite(out.logits).all() and all(bool(n.eq(401).all()) for n in cache.seq_lengths())
    assert calls == [torch.Size([1, 4, 1, 16])] * 2  # every layer's decode step read through the retrieval
