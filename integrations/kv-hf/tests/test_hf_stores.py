"""Store features the adapter must honour: the view's logit bias, query-dependent reads, beam reordering."""

import math

import pytest
import torch
from kvhf_testkit import ZeroScorer, full_compressor, prompt, tiny_model
from transformers import DynamicCache

import kv_hf
from kvcore import Budget, Compressor, DenseStore, KVView, TopKSelector

DOUBLED = 3  # position whose entry carries bias log 2


class DoubledStore(DenseStore):
    """Adds ``log 2`` to the logit of one position: attention-wise the same as holding that entry twice."""

    def read(self, query=None):
        v = super().read(query)
        bias = v.logit_bias.masked_fill(v.positions == DOUBLED, math.log(2.0))
        return KVView(v.keys, v.values, v.positions, bias)


class QueryStore(DenseStore):
    """A query-dependent store (SEKV zoom-in style): records the query every read gets."""

    query_dependent = True

    def __init__(self):
        super().__init__()
        self.queries = []

    def read(self, query=None):
        self.queries.append(query)
        return super().read(query)


def _keep_all(store):
    return Compressor(ZeroScorer(), TopKSelector(), store, Budget(ratio=0.0))


@torch.no_grad()
def test_view_logit_bias_enters_attention():
    model = tiny_model("llama")
    ids = prompt(9)
    cache = kv_hf.compressed_cache(model, _keep_all(DoubledStore))
    model(ids, past_key_values=cache)
    ref = DynamicCache(config=model.config)
    model(ids, past_key_values=ref)
    for layer in ref.layers:  # the reference holds the doubled entry twice
        layer.keys = torch.cat([layer.keys, layer.keys[:, :, DOUBLED : DOUBLED + 1]], 2)
        layer.values = torch.cat([layer.values, layer.values[:, :, DOUBLED : DOUBLED + 1]], 2)
    tok = torch.tensor([[17]])
    got = model(tok, past_key_values=cache, position_ids=torch.tensor([[9]])).logits
    want = model(tok, past_key_values=ref, position_ids=torch.tensor([[9]])).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    plain = kv_hf.compressed_cache(model, full_compressor())
    model(ids, past_key_values=plain)
    assert not torch.allclose(
        model(tok, past_key_values=plain, position_ids=torch.tensor([[9]])).logits, got, atol=1e-4
    )
    with pytest.raises(ValueError, match="non-zero finite logit bias"):
        cache.recompress(target_length=4)


@torch.no_grad()
def test_query_dependent_store_reads_with_the_current_query():
    model = tiny_model("qwen3")
    ids = prompt(11)
    cache = kv_hf.compressed_cache(model, _keep_all(QueryStore))
    ref = DynamicCache(config=model.config)
    assert torch.equal(model(ids, past_key_values=cache).logits, model(ids, past_key_values=ref).logits)
    tok = torch.tensor([[5]])
    for _ in range(3):
        got, want = model(tok, past_key_values=cache).logits, model(tok, past_key_values=ref).logits
        assert torch.equal(got, want)
        tok = got[:, -1:].argmax(-1)
    store = cache.layers[1].store
    assert len(store.queries) == 3 and all(tuple(q.shape) == (1, 4, 1, 16) for q in store.queries)


@torch.no_grad()
def test_beam_search_reorders_the_stores():
    model = tiny_model("llama")
    ids = prompt(10)
    ref = model.generate(
        ids, max_new_tokens=6, do_sample=False, num_beams=3, past_key_values=DynamicCache(config=model.config)
    )
    got = model.generate(
        ids,
        max_new_tokens=6,
        do_sample=False,
        num_beams=3,
        past_key_values=kv_hf.compressed_cache(model, full_compressor()),
    )
    assert torch.equal(ref, got)
