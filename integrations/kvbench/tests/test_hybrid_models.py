"""Every registered method on a hybrid model (sliding-window layers beside global ones, as in Gemma 3).

Invariants: the global layers are compressed by the method (their Stores hold at most what the budget keeps), the
sliding-window layers hold exactly transformers' window (the last ``sliding_window - 1`` tokens, bit for bit equal
to ``DynamicCache``'s), ``nbytes()`` counts both, and greedy decoding runs. A rolled-back answer leaves the windows
exactly as they were, and a prefill collected once compresses to the cache ``kv_hf.prefill`` builds.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kv_hf
from kv_hf.testing import tiny_model
from kvcore import Budget
from kvcore.registry import discover

REGISTRY = discover()
T, W = 200, 8
# SEKV's registered methods carry the routers shipped for SmolLM2 and Gemma 3 (chosen by KV shape, trained for
# those models' layers): they are checked below with a router built for the tiny model
SEKV = sorted(name for name in REGISTRY if name.startswith("sekv"))
# FastKVzip's registered methods carry the gate trained for SmolLM2: checked below with seeded gates for the model
FASTKVZIP = ("fastkvzip", "hubkv-fastkvzip")


class CharTokenizer:
    """One id per character: what KVzip's reconstruction pass needs of a tokenizer."""

    bos_token_id, eos_token_id = 1, 2

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [3 + (ord(c) % 250) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i > 2)


SHAPES = {
    "tiny": {},
    # Gemma 3 270M's attention shape: one KV head of 256 channels under 4 query heads
    "gemma3-270m-heads": {"num_key_value_heads": 1, "head_dim": 256, "num_attention_heads": 4},
}


def _model(shape="tiny"):
    # layers 0, 2 sliding; 1, 3 global
    return tiny_model("gemma3", num_hidden_layers=4, sliding_window=W, **SHAPES[shape])


def _ids(seed=0):
    return torch.randint(3, 250, (1, T), generator=torch.Generator().manual_seed(seed))


def _sekv_for(model):
    from kv_sekv import SEKVConfig, SEKVRouter, sekv

    c = model.config
    config = SEKVConfig(window=4, min_span=3, max_rank=8, proj_dim=8)
    router = SEKVRouter.untrained(4, c.num_attention_heads, c.num_key_value_heads, c.head_dim, config, seed=0)
    return sekv(0.5, router=router, config=config)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    "name",
    sorted(set(REGISTRY) - set(SEKV) - set(FASTKVZIP))
    + ["sekv (router for the tiny model)", "fastkvzip (gate for the tiny model)", "hubkv-fastkvzip (gate for it)"],
)
@torch.no_grad()
def test_every_method_compresses_the_global_layers_and_keeps_the_windows(name, shape):
    model, ids = _model(shape), _ids()
    if name.startswith("sekv"):
        budget, compressor = Budget(ratio=0.5), _sekv_for(model)
    elif "fastkvzip" in name:
        from kv_baselines import fastkvzip
        from kv_baselines.scorers.fastkvzip import UntrainedGates
        from kv_hubkv import hubkv

        budget, compressor = Budget(ratio=0.5), fastkvzip(0.5, gate=UntrainedGates())
        compressor = hubkv(compressor) if name.startswith("hubkv") else compressor
    else:
        method = REGISTRY[name]
        budget = Budget(ratio=0.5) if "ratio" in method.budgets else None
        compressor = method.build(budget)
    cache = kv_hf.compressed_cache(model, compressor)
    assert [layer.layer_idx for layer in cache.compressed] == [1, 3]
    assert [window.layer_idx for window in cache.windows] == [0, 2]
    logits = kv_hf.prefill(model, cache, ids, tokenizer=CharTokenizer())
    ref = DynamicCache(config=model.config)
    model(ids, past_key_values=ref)
    for window in cache.windows:
        assert torch.equal(window.keys, ref.layers[window.layer_idx].keys)
        assert window.keys.shape[-2] == W - 1
    held = sum(w.nbytes() for w in cache.windows) + sum(layer.nbytes() for layer in cache.compressed)
    assert cache.nbytes() == held > 0
    if budget is not None:  # the ratio applies to the global layers' tokens
        assert all(int(n.max()) <= T for n in cache.seq_lengths())
        # accelerator-resident bytes (SEKV keeps its span bases in host memory on purpose) below the full layers'
        assert sum(layer.store.resident_nbytes() for layer in cache.compressed) < sum(
            ref.layers[layer.layer_idx].keys.nbytes * 2 for layer in cache.compressed
        )
    for step in range(4):  # greedy decode over the compressed global layers and the sliding windows
        token = logits.argmax(-1, keepdim=True)
        logits = model(token, past_key_values=cache, position_ids=torch.tensor([[T + step]])).logits[:, -1]
        assert torch.isfinite(logits).all()
    assert cache.get_seq_length() == T + 4
    assert all(w.cumulative_length == T + 4 and w.keys.shape[-2] == W - 1 for w in cache.windows)


@torch.no_grad()
def test_a_rolled_back_answer_restores_the_windows_exactly():
    model, ids = _model(), _ids(1)
    cache = kv_hf.compressed_cache(model, REGISTRY["snapkv"].build(Budget(ratio=0.5)))
    kv_hf.prefill(model, cache, ids)
    before = [(w.keys.clone(), w.values.clone(), w.cumulative_length) for w in cache.windows]
    question = torch.randint(3, 250, (1, 5), generator=torch.Generator().manual_seed(2))
    first = kv_hf.generate_answer(model, cache, question, max_new_tokens=12)  # 5 + 12 tokens > the window
    for w, (k, v, n) in zip(cache.windows, before):
        assert torch.equal(w.keys, k) and torch.equal(w.values, v) and w.cumulative_length == n
    assert torch.equal(kv_hf.generate_answer(model, cache, question, max_new_tokens=12), first)


@torch.no_grad()
def test_a_collected_prefill_compresses_to_what_prefill_builds():
    model, ids = _model(), _ids(3)
    compressor = REGISTRY["snapkv"].build(Budget(ratio=0.5))
    direct = kv_hf.compressed_cache(model, compressor)
    kv_hf.prefill(model, direct, ids)
    shared = kv_hf.collect_prefill(model, ids).compress(compressor)
    for a, b in zip(direct.windows, shared.windows):
        assert torch.equal(a.keys, b.keys) and a.cumulative_length == b.cumulative_length
    for a, b in zip(direct.compressed, shared.compressed):
        va, vb = a.store.read(), b.store.read()
        assert torch.equal(va.keys, vb.keys) and torch.equal(va.positions, vb.positions)


@torch.no_grad()
def test_a_window_holds_only_its_tokens_after_a_long_prefill():
    # transformers' sliding layer keeps its window as a slice of the prompt-long [past | new] tensor, so the whole
    # prompt stays allocated until the next update; the kv_hf window copies itself out and frees it
    model, ids = _model(), _ids()
    cache = kv_hf.compressed_cache(model, REGISTRY["full"].build(None))
    kv_hf.prefill(model, cache, ids)
    c = model.config
    window_bytes = 2 * (W - 1) * c.num_key_value_heads * c.head_dim * 4  # K and V, float32
    assert [w.nbytes() for w in cache.windows] == [window_bytes] * len(cache.windows)
    ref = DynamicCache(config=model.config)
    model(ids, past_key_values=ref)
    assert ref.layers[0].keys.untyped_storage().nbytes() > window_bytes  # what the copy avoids
    token = torch.tensor([[5]])
    model(token, past_key_values=cache, position_ids=torch.tensor([[T]]))
    assert all(w.nbytes() <= 2 * window_bytes for w in cache.windows)  # a decode step's slice is not copied
