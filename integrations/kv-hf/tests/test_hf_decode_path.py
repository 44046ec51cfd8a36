"""The single-token decode path: the token is appended first, then one fused ``attend`` (or, for a Store without
one, attention over ``read()``) sees everything; a failing ``attend`` or ``read`` leaves the layer as it was; the
append-first path equals the concatenating one; queries are captured after compression only when a scorer needs
them."""

from __future__ import annotations

import pytest
import torch
from kvhf_testkit import KnormScorer, make, prompt, tiny_model

import kv_hf
from kvcore import DenseStore, reference_attention


class FlakyStore(DenseStore):
    """Attends like the reference over its own view; raises once ``fail`` is set."""

    can_attend = True
    fail = False

    def attend(self, query, scale=None):
        if FlakyStore.fail:
            raise RuntimeError("attend failed")
        return reference_attention(self.read(), query, scale)


class FlakyReadStore(DenseStore):
    """A DenseStore (no fused attend) whose next read raises once ``fail`` is set (the rollback's own reads work)."""

    fail = False

    def read(self, query=None):
        if FlakyReadStore.fail:
            FlakyReadStore.fail = False
            raise RuntimeError("read failed")
        return super().read(query)


class QueryKnormScorer(KnormScorer):
    """The key-norm scorer declaring that it needs queries (as SnapKV does)."""

    needs_queries = True


def _with_store(comp, store):
    return type(comp)(comp.scorer, comp.selector, store, comp.budget, comp.protect)


@pytest.mark.parametrize(
    "store, message",
    [(FlakyStore, "attend failed"), (FlakyReadStore, "read failed")],
    ids=["fused-attend", "append-first-read"],
)
@torch.no_grad()
def test_a_failing_decode_step_rolls_the_token_back(store, message):
    """The decode token is appended before attention (a fused attend, or attention over read() for a Store
    without one); when the attend or the read raises, the token is rolled back and decoding goes on."""
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, _with_store(make(KnormScorer(), ratio=0.5), store))
    model(prompt(12, seed=3), past_key_values=cache)
    tok = torch.tensor([[7]])
    model(tok, past_key_values=cache)
    before = [(layer.seen, layer.store.seq_lengths().clone(), layer.next_positions.clone()) for layer in cache.layers]
    store.fail = True
    try:
        with pytest.raises(RuntimeError, match=message):
            model(tok, past_key_values=cache)
    finally:
        store.fail = False
    layer = cache.layers[0]  # the first layer appended the token, then its attend (or read) raised
    seen, lengths, nxt = before[0]
    assert layer.seen == seen
    assert torch.equal(layer.store.seq_lengths(), lengths)
    assert torch.equal(layer.next_positions, nxt)
    assert layer._step is None
    # decoding goes on from where it was, with the same logits as a cache that never failed
    ref = kv_hf.compressed_cache(model, _with_store(make(KnormScorer(), ratio=0.5), store))
    model(prompt(12, seed=3), past_key_values=ref)
    model(tok, past_key_values=ref)
    torch.testing.assert_close(
        model(tok, past_key_values=cache).logits, model(tok, past_key_values=ref).logits, rtol=0, atol=0
    )


@pytest.mark.parametrize("needs_queries", [False, True])
@torch.no_grad()
def test_decode_queries_are_captured_only_for_scorers_that_need_them(needs_queries):
    model = tiny_model("llama")
    scorer = QueryKnormScorer() if needs_queries else KnormScorer()
    assert scorer.needs_queries is needs_queries
    cache = kv_hf.compressed_cache(model, make(scorer, ratio=0.5), query_window=4)
    model(prompt(12, seed=4), past_key_values=cache)
    layer = cache.layers[0]
    after_prefill = layer.queries.clone()
    model(torch.tensor([[9]]), past_key_values=cache)
    assert torch.equal(layer.queries, after_prefill) is not needs_queries
    assert layer.queries.shape == after_prefill.shape


@pytest.mark.parametrize("granularity", ["head", "layer"])  # equal heads (a zero-copy view) / ragged heads (padded)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@torch.no_grad()
def test_append_first_decode_equals_the_concatenating_path(granularity, attn, monkeypatch):
    """A decode token over a Store without a fused attend is appended first and attended over read(): the logits
    equal those of the [view | new] concatenation (the path taken for padded steps), over equal and ragged heads."""
    model = tiny_model("llama", attn)
    logits = {}
    for append_first in (True, False):
        if not append_first:
            monkeypatch.setattr(kv_hf.layer.CompressedLayer, "plain_decode", lambda self, k: False)
        cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5, granularity=granularity))
        tok = kv_hf.prefill(model, cache, prompt(16, seed=5)).argmax(-1)[:, None]
        steps = []
        for _ in range(4):
            out = model(tok, past_key_values=cache)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            steps.append(out.logits[:, -1])
        logits[append_first] = torch.stack(steps)
        ragged = not bool((cache.layers[0].store.seq_lengths() == cache.layers[0].store.seq_lengths()[0, 0]).all())
        assert ragged is (granularity == "layer")
    torch.testing.assert_close(logits[True], logits[False], rtol=1e-5, atol=1e-5)
