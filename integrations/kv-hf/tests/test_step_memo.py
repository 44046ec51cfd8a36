"""StepMemo: the layers of a decode step share the positions and next positions the first layer computed."""

from __future__ import annotations

import torch
from kvhf_testkit import full_compressor, prompt, tiny_model

import kv_hf
from kv_hf.step_memo import StepMemo


def test_the_same_inputs_give_the_same_object_and_anything_else_recomputes():
    memo, calls = StepMemo(), []

    def compute(x, n):
        calls.append(1)
        return x * n

    p = torch.arange(3)
    a = memo.get("f", (p, 2), lambda: compute(p, 2))
    assert memo.get("f", (p, 2), lambda: compute(p, 2)) is a and len(calls) == 1
    assert torch.equal(memo.get("f", (p, 3), lambda: compute(p, 3)), p * 3)  # another value
    assert torch.equal(memo.get("f", (p.clone(), 3), lambda: compute(p, 3)), p * 3)  # an equal but other tensor
    b = memo.get("f", (p, 3), lambda: compute(p, 3))
    p.add_(1)  # written in place: the version moved
    assert memo.get("f", (p, 3), lambda: compute(p, 3)) is not b and len(calls) == 5
    assert memo.get("g", (None, 1), lambda: "g") == "g" and memo.get("g", (None, 1), lambda: "other") == "g"
    assert memo.get("g", (p, 1), lambda: "tensor now") == "tensor now"  # None vs a tensor: not the same


@torch.no_grad()
def test_every_layer_of_a_step_holds_the_same_next_positions():
    """After the prefill and each decode step, every layer holds one shared next-positions tensor with the values
    each layer computed on its own before: a left-padded batch decoded with position_ids, and a batch without
    padding decoded without them (transformers then counts positions from the cache length)."""
    model = tiny_model("llama")
    for padded in (True, False):
        cache = kv_hf.compressed_cache(model, full_compressor())
        ids = prompt(12, seed=1).expand(2, -1).clone()
        mask = torch.ones_like(ids)
        if padded:
            mask[1, :3] = 0  # left padding: row 1's positions start three later
        tok = kv_hf.prefill(model, cache, ids, attention_mask=mask).argmax(-1)[:, None]
        want = torch.tensor([12, 9] if padded else [12, 12])
        for _ in range(3):
            first = cache.layers[0].next_positions
            assert all(layer.next_positions is first for layer in cache.layers)
            assert first.tolist() == want.tolist()
            pos = first[:, None] if padded else None
            out = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True)
            tok, want = out.logits[:, -1].argmax(-1, keepdim=True), want + 1
