"""Periodic re-compression while decoding (kvpress DecodingPress, HqeKV re-tiering, decoding-stage HubKV)."""

import pytest
import torch
from kvhf_testkit import KnormScorer, Recording, WindowScorer, make, prompt, tiny_model

import kv_hf
from kvcore import Budget, Protection


def _lengths(cache):
    return [layer.store.seq_lengths() for layer in cache.layers]


@torch.no_grad()
def test_recompress_every_n_trims_to_target_length():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.25), recompress_every=4, target_length=10)
    ids = prompt(16)
    logits = model(ids, past_key_values=cache).logits[:, -1]
    assert all(bool((n == 12).all()) for n in _lengths(cache))
    for step in range(1, 13):
        logits = model(logits.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
        since = step % 4
        expect = 10 + since if step >= 4 else 12 + step
        assert all(bool((n == expect).all()) for n in _lengths(cache)), (step, _lengths(cache))
        assert all(layer.recompressions == step // 4 for layer in cache.layers)
    # every held entry is a true position of the tokens seen, sorted per head
    for layer in cache.layers:
        pos = layer.store.read().positions[0]
        assert bool((pos >= 0).all()) and bool((pos < 16 + 12).all()) and bool((pos.diff(dim=-1) > 0).all())


@torch.no_grad()
def test_recompression_keeps_the_content_of_surviving_entries_on_a_ragged_layout():
    model = tiny_model("qwen2")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    model(prompt(20, seed=3), past_key_values=cache)
    before = [layer.store.read() for layer in cache.layers]
    assert not bool((before[0].positions[:, 0] == before[0].positions[:, 1]).all())  # heads hold different tokens
    cache.recompress(target_length=6)
    for layer, old in zip(cache.layers, before):
        new = layer.store.read()
        assert bool((layer.store.seq_lengths() == 6).all())
        for h in range(new.keys.shape[1]):
            keep = torch.isin(old.positions[0, h], new.positions[0, h])
            assert int(keep.sum()) == 6
            assert torch.equal(new.keys[0, h], old.keys[0, h][keep]) and torch.equal(
                new.values[0, h], old.values[0, h][keep]
            )
            # Knorm keeps the 6 lowest-norm keys of what the head held
            norms = old.keys[0, h].norm(dim=-1)
            assert set(torch.topk(-norms, 6).indices.tolist()) == set(keep.nonzero().squeeze(-1).tolist())


@torch.no_grad()
def test_target_ratio_is_relative_to_tokens_seen_and_uses_decode_queries():
    model = tiny_model("qwen3")
    rec = Recording(WindowScorer())
    recompressor = make(rec, ratio=0.5, protect=Protection(recent=2))
    cache = kv_hf.compressed_cache(
        model,
        make(KnormScorer(), ratio=0.0),
        query_window=3,
        recompress_every=5,
        target_ratio=0.5,
        recompressor=recompressor,
    )
    out = model.generate(prompt(15), max_new_tokens=6, do_sample=False, past_key_values=cache)
    assert out.shape[1] == 21
    seen_at_recompress = 15 + 5
    assert all(bool((n == Budget(ratio=0.5).kept(seen_at_recompress)).all()) for n in _lengths(cache))
    assert len(rec.contexts) == 2  # one per layer: the ratio-0 prefill left a head-uniform layout
    assert all(tuple(c.queries.shape) == (1, 4, 3, 16) for c in rec.contexts)
    # the queries are the last 3 decode steps: check layer 0 against the model's own post-RoPE queries
    from kvhf_testkit import naive_qk

    q, _ = naive_qk(model, out[:, :20], 0)
    torch.testing.assert_close(rec.contexts[0].queries, q[:, :, 17:20], rtol=0, atol=1e-4)


@torch.no_grad()
def test_recompress_with_layer_granularity_on_uniform_layout():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.0, granularity="layer"))
    model(prompt(12), past_key_values=cache)
    cache.recompress(target_length=5)
    for n in _lengths(cache):
        assert int(n.sum()) == 2 * 5  # exact per layer, spread over heads


@torch.no_grad()
def test_ragged_recompress_needs_head_granularity():
    model = tiny_model("llama")
    comp = make(KnormScorer(), ratio=0.5)
    cache = kv_hf.compressed_cache(model, comp, recompressor=make(KnormScorer(), granularity="layer"))
    model(prompt(12), past_key_values=cache)
    with pytest.raises(ValueError, match="granularity 'head'"):
        cache.recompress(target_length=3)


@torch.no_grad()
def test_compress_next_prefill_merges_a_second_prompt():
    """Re-arming compresses the next forward together with what is stored (chunk-wise prompt compression)."""
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    ids = prompt(24, seed=12)
    model(ids[:, :12], past_key_values=cache)
    assert not cache.compress_next_prefill
    cache.compress_next_prefill = True
    model(ids[:, 12:], past_key_values=cache)
    assert cache.get_seq_length() == 24
    for layer in cache.layers:
        assert bool((layer.store.seq_lengths() == Budget(ratio=0.5).kept(6 + 12)).all())
        pos = layer.store.read().positions
        assert bool((pos < 24).all()) and bool(((pos >= 12).sum(-1) > 0).all())


def _own_replanner(calls, keep):
    """A compressor-declared re-planner that records its calls and keeps the ``keep`` newest entries per head."""
    from kvcore import EVICT, Plan, replan_view

    def replanner(store, compressor, **kwargs):
        calls.append((compressor.budget, kwargs["queries"]))
        plan = replan_view(store, compressor, **kwargs)
        bits = plan.key_bits.clone()
        bits[..., : max(0, bits.shape[-1] - keep)] = EVICT
        return Plan(bits)

    return replanner


@torch.no_grad()
def test_compressor_declared_replan_runs_every_n_tokens_under_its_own_budget():
    """A compressor with ``replan_every`` (HqeKV's re-tiering) is re-planned every N committed tokens with no
    target, through its own ``replanner`` and budget; ``CacheOptions(replan=False)`` and a paused cache skip it."""
    import dataclasses

    model = tiny_model("llama")
    calls = []
    base = make(WindowScorer(), ratio=0.0)
    comp = dataclasses.replace(base, replan_every=4, replanner=_own_replanner(calls, keep=10))
    cache = kv_hf.compressed_cache(model, comp, query_window=3)
    logits = model(prompt(16), past_key_values=cache).logits[:, -1]
    for step in range(1, 9):
        logits = model(logits.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
        assert all(layer.recompressions == step // 4 for layer in cache.layers)
    assert len(calls) == 2 * len(cache.layers) and all(b == base.budget for b, _ in calls)
    assert all(q is not None and q.shape[2] == 3 for _, q in calls)
    assert all(bool((n == 10).all()) for n in _lengths(cache))

    off = kv_hf.compressed_cache(model, comp, replan=False)
    logits = model(prompt(16), past_key_values=off).logits[:, -1]
    for _ in range(8):
        logits = model(logits.argmax(-1, keepdim=True), past_key_values=off).logits[:, -1]
    assert all(layer.recompressions == 0 for layer in off.layers)
    assert all(bool((n == 24).all()) for n in _lengths(off))


@torch.no_grad()
def test_a_rollback_uncounts_the_tokens_it_removes_from_the_replan_period():
    """``replan_every`` counts the tokens the Store holds since the last re-plan: rolled-back tokens no longer count
    (a decode rate measured in rounds rolled back to the context, or a multi-question protocol, would otherwise
    re-plan on tokens that are gone), and tokens kept by a partial rollback still do."""
    import dataclasses

    model = tiny_model("llama")
    comp = dataclasses.replace(make(WindowScorer(), ratio=0.0), replan_every=4, replanner=_own_replanner([], keep=10))
    cache = kv_hf.compressed_cache(model, comp)
    logits = model(prompt(16), past_key_values=cache).logits[:, -1]
    tok = logits.argmax(-1, keepdim=True)

    def step(n):
        nonlocal tok
        for _ in range(n):
            tok = model(tok, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)

    for _ in range(3):  # three rounds of 3 tokens, each rolled back: 9 decoded, never 4 held since the prefill
        step(3)
        cache.rollback(16)
    assert all(layer.recompressions == 0 for layer in cache.layers)
    step(3)
    cache.rollback(18)  # keeps 2 of the 3
    step(1)
    assert all(layer.recompressions == 0 for layer in cache.layers)  # 3 held since the prefill
    step(1)
    assert all(layer.recompressions == 1 for layer in cache.layers)  # the 4th


@torch.no_grad()
def test_a_rollback_forgets_the_queries_of_the_slots_it_cuts():
    """The remembered query window loses the queries of rolled-back tokens (a later compression would otherwise
    score the context with a rolled-back question's queries) and keeps the others in order."""
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(WindowScorer(), ratio=0.5), query_window=3)
    logits = model(prompt(16), past_key_values=cache).logits[:, -1]
    q0 = [layer.queries.clone() for layer in cache.layers]  # the prompt's last 3 queries (slots 13-15)
    tok = logits.argmax(-1, keepdim=True)
    for _ in range(2):  # the window now holds slots 15, 16, 17
        tok = model(tok, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
    assert all(not torch.equal(layer.queries, q) for layer, q in zip(cache.layers, q0))
    cache.rollback(16)
    assert all(torch.equal(layer.queries, q[:, :, -1:]) for layer, q in zip(cache.layers, q0))  # slot 15 only
    model(tok, past_key_values=cache)
    assert all(layer.queries.shape[2] == 2 and torch.equal(layer.queries[:, :, :1], q[:, :, -1:])
               for layer, q in zip(cache.layers, q0))  # fmt: skip
    cache.rollback(15)  # every remembered slot cut
    assert all(layer.queries is None for layer in cache.layers)


@torch.no_grad()
def test_answer_pauses_a_declared_replan_so_the_context_comes_back():
    """kv_hf.generate_answer rolls the answer back; the compressor's own re-plan waits meanwhile, so the context
    held before the question is held again after it."""
    import dataclasses

    model = tiny_model("llama")
    comp = dataclasses.replace(make(WindowScorer(), ratio=0.0), replan_every=2, replanner=_own_replanner([], keep=4))
    cache = kv_hf.compressed_cache(model, comp)
    model(prompt(12), past_key_values=cache)
    before = [layer.store.read().positions.clone() for layer in cache.layers]
    kv_hf.generate_answer(model, cache, prompt(3, seed=5), max_new_tokens=6)
    assert all(torch.equal(b, layer.store.read().positions) for b, layer in zip(before, cache.layers))
    assert all(layer.recompressions == 0 for layer in cache.layers) and not cache.replan_paused
