"""One write path: fresh layers are written once, held entries are only re-tiered, global budgets write into the
layers' own Stores, layers hold no reference to their cache, and Stores with a fused ``attend`` are decoded
through it."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from kvhf_testkit import CharTokenizer, KnormScorer, make, prompt, tiny_model

import kv_baselines
import kv_hf
from kvcore import Budget, DenseStore, Plan, Protection, reference_attention


class CountingStore(DenseStore):
    """A DenseStore that counts its mutations (class-level, so every layer's store adds to the same counts)."""

    counts: ClassVar[dict[str, int]] = {}

    def write(self, keys, values, plan, positions):
        CountingStore.counts["write"] = CountingStore.counts.get("write", 0) + 1
        super().write(keys, values, plan, positions)

    def retier(self, plan: Plan) -> None:
        CountingStore.counts["retier"] = CountingStore.counts.get("retier", 0) + 1
        super().retier(plan)


class AttendingStore(DenseStore):
    """A DenseStore declaring a fused ``attend`` (the reference over its own view) and counting its calls."""

    can_attend = True
    calls: ClassVar[list[tuple[int, ...]]] = []

    def attend(self, query, scale=None):
        AttendingStore.calls.append(tuple(query.shape))
        return reference_attention(self.read(), query, scale)


@pytest.fixture(autouse=True)
def _reset_counts():
    CountingStore.counts = {}
    AttendingStore.calls = []


def _counting(ratio=0.5, granularity="head", store=CountingStore, **kw):
    comp = make(KnormScorer(), ratio=ratio, granularity=granularity, **kw)
    return type(comp)(comp.scorer, comp.selector, store, comp.budget, comp.protect)


def test_layers_hold_no_reference_to_their_cache():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer()))
    for layer in cache.layers:
        assert not hasattr(layer, "owner")
        assert not any(value is cache for value in vars(layer).values())


@torch.no_grad()
def test_a_fresh_prefill_is_one_write_per_layer_and_recompression_only_retiers():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, _counting(), recompress_every=3, target_length=6)
    logits = model(prompt(16), past_key_values=cache).logits[:, -1]
    assert CountingStore.counts == {"write": 2}  # Compressor.compress once per layer
    stores = [layer.store for layer in cache.layers]
    for _ in range(6):
        logits = model(logits.argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1]
    assert CountingStore.counts == {"write": 2, "retier": 2 * 2}  # two re-compressions per layer, no write
    assert [layer.store for layer in cache.layers] == stores
    assert all(bool((layer.store.seq_lengths() == 6).all()) for layer in cache.layers)
    assert all(layer.recompressions == 2 for layer in cache.layers)


@torch.no_grad()
def test_merging_a_second_prefill_appends_then_retiers_without_rewriting_held_entries():
    model = tiny_model("qwen2")
    cache = kv_hf.compressed_cache(model, _counting(ratio=0.5))
    ids = prompt(24, seed=21)
    model(ids[:, :12], past_key_values=cache)
    held = [layer.store.read() for layer in cache.layers]
    held = [(v.keys.clone(), v.positions.clone()) for v in held]
    cache.compress_next_prefill = True
    model(ids[:, 12:], past_key_values=cache)
    assert CountingStore.counts == {"write": 2, "retier": 2}
    for layer, (keys, positions) in zip(cache.layers, held):
        assert bool((layer.store.seq_lengths() == Budget(ratio=0.5).kept(6 + 12)).all())
        view = layer.store.read()
        for h in range(keys.shape[1]):
            # every surviving entry of the first prompt is bit-identical to what was held
            kept = torch.isin(positions[0, h], view.positions[0, h])
            mine = view.positions[0, h] < 12
            assert torch.equal(view.keys[0, h][mine], keys[0, h][kept])


@torch.no_grad()
def test_a_padded_prefill_is_not_merged_into_a_compressed_layer():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, make(KnormScorer(), ratio=0.5))
    ids = prompt(8, B=2, seed=22)
    kv_hf.prefill(model, cache, ids)
    mask = torch.ones(2, 4, dtype=torch.long)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match="padded prefill cannot be merged"):
        kv_hf.prefill(model, cache, prompt(4, B=2, seed=23), mask)


@torch.no_grad()
def test_global_budget_writes_into_the_existing_stores():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, _counting(ratio=0.5, granularity="global"))
    stores = [layer.store for layer in cache.layers]
    model(prompt(14, seed=24), past_key_values=cache)
    assert [layer.store for layer in cache.layers] == stores  # never replaced
    assert CountingStore.counts == {"write": 2}
    assert sum(int(s.seq_lengths().sum()) for s in stores) == 2 * 2 * Budget(ratio=0.5).kept(14)
    assert all(layer.pending is None and layer.mode == "store" for layer in cache.layers)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_decode_through_store_attend_matches_the_read_path(family, attn):
    model = tiny_model(family, attn=attn)
    comp = make(KnormScorer(), ratio=0.5, protect=Protection(sinks=1))
    fused = type(comp)(comp.scorer, comp.selector, AttendingStore, comp.budget, comp.protect)
    ids = prompt(15, seed=25)
    cache_r = kv_hf.compressed_cache(model, comp)
    cache_f = kv_hf.compressed_cache(model, fused)
    lr = model(ids, past_key_values=cache_r).logits[:, -1]
    lf = model(ids, past_key_values=cache_f).logits[:, -1]
    assert AttendingStore.calls == []  # nothing held yet during the prefill
    torch.testing.assert_close(lf, lr, rtol=0, atol=0)
    steps = 4
    for _ in range(steps):
        nxt = lr.argmax(-1, keepdim=True)
        lr = model(nxt, past_key_values=cache_r).logits[:, -1]
        lf = model(nxt, past_key_values=cache_f).logits[:, -1]
        torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-5)
    assert len(AttendingStore.calls) == steps * model.config.num_hidden_layers
    assert all(shape == (1, 4, 1, 16) for shape in AttendingStore.calls)
    # a multi-token step after compression: causal among the new tokens, merged with the Store's part
    more = prompt(3, seed=26)
    lr = model(more, past_key_values=cache_r).logits
    lf = model(more, past_key_values=cache_f).logits
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-5)
    assert AttendingStore.calls[-1] == (1, 4, 3, 16)


@torch.no_grad()
def test_fused_attend_with_a_pending_chunk_matches_the_read_path():
    """A second prefill collected raw over a held store: the pending part is attended beside the fused Store."""
    model = tiny_model("llama")
    comp = make(KnormScorer(), ratio=0.5)
    fused = type(comp)(comp.scorer, comp.selector, AttendingStore, comp.budget, comp.protect)
    ids = prompt(20, seed=27)
    outs = []
    for c in (comp, fused):
        cache = kv_hf.compressed_cache(model, c)
        model(ids[:, :10], past_key_values=cache)
        cache.collect()
        model(ids[:, 10:15], past_key_values=cache)
        outs.append(model(ids[:, 15:], past_key_values=cache).logits)  # attends to Store + pending + new
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert any(shape[2] == 5 for shape in AttendingStore.calls)


def test_provider_table_refuses_unknown_extras_and_options():
    from dataclasses import dataclass

    from kvcore import Scorer, Scores

    @dataclass(frozen=True)
    class NeedsSurprisal(Scorer):  # an extra no provider supplies
        needs_extras: ClassVar[frozenset[str]] = frozenset({"hidden_states"})

        def score(self, ctx):
            return Scores(ctx.extras["hidden_states"])

    assert "kvzip_scores" in kv_hf.PROVIDERS
    from kv_hf.providers import providers_for

    with pytest.raises(ValueError, match=r"no kv_hf provider supplies the extras \['hidden_states'\].*'kvzip_scores'"):
        providers_for({"hidden_states", "kvzip_scores"})
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"\['hidden_states'\].*kvzip_scores"):
        kv_hf.compressed_cache(model, make(NeedsSurprisal()))
    cache = kv_hf.compressed_cache(model, make(KnormScorer()))
    with pytest.raises(TypeError, match=r"unknown prefill options \['kvzipp'\].*'kvzip'.*'surprisal'"):
        kv_hf.prefill(model, cache, prompt(8), kvzipp=None)
    with pytest.raises(TypeError, match="KVzipConfig"):
        kv_hf.prefill(
            model,
            kv_hf.compressed_cache(model, kv_baselines.kvzip(0.5)),
            prompt(8),
            tokenizer=CharTokenizer(),
            kvzip={"chunk_size": 4},
        )


@torch.no_grad()
def test_prefill_runs_the_provider_the_scorer_declares():
    seen = []
    from kv_hf import providers

    real = providers.PROVIDERS["kvzip_scores"]

    def spy(*args, **kwargs):
        seen.append(kwargs["config"])
        return real.run(*args, **kwargs)

    providers.PROVIDERS["kvzip_scores"] = providers.Provider(real.name, real.option, real.check, spy, real.description)
    try:
        model = tiny_model("llama")
        config = kv_hf.KVzipConfig(chunk_size=6)
        cache = kv_hf.compressed_cache(model, kv_baselines.kvzip(0.5))
        kv_hf.prefill(model, cache, prompt(12, seed=28), tokenizer=CharTokenizer(), kvzip=config)
        assert seen == [config]
        cache = kv_hf.compressed_cache(model, make(KnormScorer()))
        kv_hf.prefill(model, cache, prompt(12, seed=28), tokenizer=CharTokenizer(), kvzip=config)
        assert seen == [config]  # the Knorm scorer declares no extras: no provider runs
    finally:
        providers.PROVIDERS["kvzip_scores"] = real


def test_surprisal_provider_equals_the_full_log_softmax():
    """The "surprisal" extra comes from the prefill's own hidden states (no second forward pass), streamed over the
    vocabulary in chunks, and equals −log softmax(logits[t−1])[x_t] of an ordinary forward pass (0 at t = 0)."""
    from kv_hf.surprisal import SurprisalConfig, capture, provide

    model = tiny_model("llama")
    ids = prompt(20)
    cache = kv_hf.compressed_cache(model, make(KnormScorer()))
    with torch.no_grad(), capture(model) as found:
        logits = model(ids).logits
    got = provide(
        model, cache, ids, tokenizer=None, context_start=0, config=SurprisalConfig(vocab_chunk=7), captured=found
    )
    want = -torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert set(got) == {layer.layer_idx for layer in cache.layers}
    torch.testing.assert_close(got[0]["surprisal"][:, 1:], want, rtol=1e-4, atol=1e-4)
    assert not got[0]["surprisal"].requires_grad  # computed without autograd, though called with grad enabled
    assert float(got[0]["surprisal"][0, 0]) == 0.0
    with pytest.raises(ValueError, match="vocab_chunk"):
        SurprisalConfig(vocab_chunk=0)
