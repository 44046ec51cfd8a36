"""The decode step reaches the attention function explicitly (``kv_hf.step.hand_off`` / ``take_step``), never as an
attribute of the key tensor: the keys a layer returns carry nothing, another cache's keys get no step, a step is
taken once, and a layer carries the cache's ``on_commit`` to its steps."""

from __future__ import annotations

import torch
from kvhf_testkit import KnormScorer, make, prompt, tiny_model

import kv_hf
from kv_hf.layer import CompressedLayer
from kv_hf.step import Step, hand_off, take_step


def test_take_step_returns_the_step_handed_over_with_those_keys_once():
    keys, other = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4)
    step = Step(layer=None, keys=keys, values=keys)
    hand_off(keys, step)
    assert take_step(other) is None  # another cache's keys (even equal values): attention runs unchanged
    assert take_step(keys) is step
    assert take_step(keys) is None  # taken once: the hand-off holds nothing afterwards


def test_a_later_update_replaces_a_step_never_taken():
    a, b = torch.zeros(1), torch.zeros(1)
    sa, sb = Step(None, a, a), Step(None, b, b)
    hand_off(a, sa)
    hand_off(b, sb)
    assert take_step(a) is None and take_step(b) is sb


@torch.no_grad()
def test_layer_update_sets_nothing_on_the_keys_and_hands_its_step_over():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    model(prompt(12, seed=3), past_key_values=cache)  # compressed: the next update takes a store path
    layer = cache.layers[0]
    assert isinstance(layer, CompressedLayer) and layer.on_commit == cache._committed
    k = torch.randn(1, layer.store.read().keys.shape[1], 1, layer.store.read().keys.shape[-1])
    keys, _ = cache.update(k, k.clone(), 0)
    assert not hasattr(keys, "_kv_hf_step") and not any(name.startswith("_kv_hf") for name in vars(keys))
    step = take_step(keys)
    assert step is layer._step and step.layer is layer and step.on_commit == cache._committed
    layer._step = None  # abandon the step (the attention function would commit it)


@torch.no_grad()
def test_decoding_leaves_no_step_in_the_hand_off():
    """Every step handed over during a generate is taken by the attention function."""
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    ids = prompt(10, seed=2)
    model.generate(ids, past_key_values=cache, max_new_tokens=3, do_sample=False)
    from kv_hf.step import _HANDOFF

    assert _HANDOFF.step is None and _HANDOFF.keys is None
    assert all(layer._step is None for layer in cache.layers)
