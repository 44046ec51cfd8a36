"""Chunked prefill with compression after every chunk (``kv_hf.prefill(..., chunk_size=N, compress_chunks=True)``):
bounded held entries, exactness where the scorer allows it, refusals."""

from __future__ import annotations

import pytest
import torch
from kvhf_testkit import prompt, tiny_model

import kv_hf
from kv_baselines import h2o, kivi, knorm, snapkv, streaming_llm
from kv_hf.prefill import chunk_compressor
from kvcore import Budget, Compressor, DenseStore, TopKSelector


def _held(cache):
    """Per layer, the [B, Hkv] entries held (the Store's own count) and the stored true positions."""
    lengths, positions = [], []
    for layer in cache.layers:
        view = layer.store.read()
        lengths.append(layer.store.seq_lengths().clone())
        pos = torch.where(view.valid, view.positions.long(), -1)
        positions.append(torch.sort(pos, dim=-1).values)
    return lengths, positions


def _one_shot(model, compressor, ids):
    cache = kv_hf.compressed_cache(model, compressor)
    logits = kv_hf.prefill(model, cache, ids)
    return cache, logits


def _chunked(model, compressor, ids, chunk):
    cache = kv_hf.compressed_cache(model, compressor)
    logits = kv_hf.prefill(model, cache, ids, chunk_size=chunk, compress_chunks=True)
    return cache, logits


@pytest.mark.parametrize("method", [lambda: knorm(0.5), lambda: snapkv(0.5, window=8), lambda: h2o(0.5)])
def test_chunk_at_least_the_prompt_equals_one_shot_exactly(method):
    model, ids = tiny_model(), prompt(40)
    ref, ref_logits = _one_shot(model, method(), ids)
    for chunk in (40, 64):
        got, logits = _chunked(model, method(), ids, chunk)
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
        for a, b in zip(_held(got), _held(ref)):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_streaming_llm_chunked_keeps_what_one_shot_keeps(chunk):
    """Position-only: sinks + the most recent tokens are the same whichever way the prompt arrives."""
    model, ids = tiny_model(), prompt(50, B=2)
    ref, _ = _one_shot(model, streaming_llm(0.6, n_sink=3), ids)
    got, _ = _chunked(model, streaming_llm(0.6, n_sink=3), ids, chunk)
    (ref_len, ref_pos), (got_len, got_pos) = _held(ref), _held(got)
    for a, b in zip(got_len, ref_len):
        assert torch.equal(a, b)
    for a, b in zip(got_pos, ref_pos):
        assert torch.equal(a, b)
    # held keys are the exact prefill keys of those positions: read back the kept entries of both caches
    for lg, lr in zip(got.layers, ref.layers):
        vg, vr = lg.store.read(), lr.store.read()
        og = torch.argsort(torch.where(vg.valid, vg.positions.long(), 1 << 40), dim=-1)
        or_ = torch.argsort(torch.where(vr.valid, vr.positions.long(), 1 << 40), dim=-1)
        kg = vg.keys.gather(2, og[..., None].expand_as(vg.keys))
        kr = vr.keys.gather(2, or_[..., None].expand_as(vr.keys))
        n = int(ref_len[0].max())
        # causal attention over a compressed cache changes later layers' inputs; layer 0 keys are input-only
        if lg.layer_idx == 0:
            torch.testing.assert_close(kg[:, :, :n], kr[:, :, :n])


@pytest.mark.parametrize("ratio", [0.5, 0.8])
@pytest.mark.parametrize("chunk", [5, 12])
@pytest.mark.parametrize("method", [knorm, lambda r: snapkv(r, window=4), h2o])
def test_held_entries_never_exceed_budget_plus_chunk(method, chunk, ratio):
    model, ids = tiny_model(), prompt(60)
    T = ids.shape[1]
    final = Budget(ratio=ratio).kept(T)
    cache = kv_hf.compressed_cache(model, method(ratio))
    peaks = []

    def watch(module, args, kwargs, output):
        # after every decoder layer's forward: the Store's entries plus the raw chunk it has pending
        for layer in cache.layers:
            held = layer.store.seq_lengths()
            pending = layer.pending.length if layer.pending is not None else 0
            peaks.append((int(held.max()) if held.numel() else 0) + pending)

    hooks = [m.register_forward_hook(watch, with_kwargs=True) for m in model.model.layers]
    try:
        kv_hf.prefill(model, cache, ids, chunk_size=chunk, compress_chunks=True)
    finally:
        for h in hooks:
            h.remove()
    assert peaks, "the hook never ran"
    assert max(peaks) <= final + chunk
    assert max(peaks) < T  # bounded below the whole prompt: that is the point
    for lengths in cache.seq_lengths():
        assert bool((lengths == final).all()), (lengths, final)
    # true positions: every held position is a prompt position, distinct per head
    for layer in cache.layers:
        view = layer.store.read()
        pos = view.positions.long()[view.valid]
        assert int(pos.min()) >= 0 and int(pos.max()) < T


def test_chunked_knorm_matches_one_shot_layer_zero_selection():
    """Knorm is key-only and layer 0's keys depend on the token and position only: chunked compression must
    keep the same layer-0 entries as one-shot (top-k of a union of top-k's is the top-k)."""
    model, ids = tiny_model(), prompt(48)
    ref, _ = _one_shot(model, knorm(0.75), ids)
    got, _ = _chunked(model, knorm(0.75), ids, 10)
    assert torch.equal(_held(got)[1][0], _held(ref)[1][0])


def test_kivi_chunked_holds_every_token_quantized():
    model, ids = tiny_model(), prompt(70)
    ref, _ = _one_shot(model, kivi(4, group_size=16, residual=16), ids)
    got, logits = _chunked(model, kivi(4, group_size=16, residual=16), ids, 20)
    for a, b in zip(got.seq_lengths(), ref.seq_lengths()):
        assert torch.equal(a, b)  # quantization only: every token kept
    assert got.nbytes() == ref.nbytes()  # same packed layout whichever way the prompt arrived
    assert got.nbytes() < 70 * 2 * 2 * 16 * 4 * 2  # quantized: below the fp32 K+V of 70 tokens, 2 heads, 2 layers
    assert torch.isfinite(logits).all()


def test_chunk_compressor_turns_a_ratio_into_the_whole_prompt_count():
    c = knorm(0.75)
    assert chunk_compressor(c, 100).budget.tokens == 25
    assert chunk_compressor(c, 100).budget.ratio is None
    tok = c.with_budget(ratio=None, tokens=7)
    assert chunk_compressor(tok, 100) is tok


# -- refusals ----------------------------------------------------------------------------------------------
def test_scorer_that_is_not_chunkable_is_refused_by_name():
    from kvhf_testkit import KnormScorer  # a test scorer that does not declare chunkable

    model = tiny_model()
    comp = Compressor(KnormScorer(), TopKSelector(), DenseStore, Budget(ratio=0.5))
    cache = kv_hf.compressed_cache(model, comp)
    with pytest.raises(ValueError, match=r"KnormScorer.*chunkable.*compress_chunks"):
        kv_hf.prefill(model, cache, prompt(20), chunk_size=4, compress_chunks=True)
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize(
    ("chunk", "err"), [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("8", TypeError)]
)
def test_bad_chunk_size_is_refused(chunk, err):
    model = tiny_model()
    cache = kv_hf.compressed_cache(model, knorm(0.5))
    with pytest.raises(err, match="chunk_size"):
        kv_hf.prefill(model, cache, prompt(20), chunk_size=chunk, compress_chunks=True)


def test_compress_chunks_needs_chunk_size_and_a_bool():
    model = tiny_model()
    cache = kv_hf.compressed_cache(model, knorm(0.5))
    with pytest.raises(ValueError, match="chunk_size"):
        kv_hf.prefill(model, cache, prompt(20), compress_chunks=True)
    with pytest.raises(TypeError, match="compress_chunks"):
        kv_hf.prefill(model, cache, prompt(20), chunk_size=4, compress_chunks=1)


def test_compress_chunks_refuses_padding_global_budgets_and_a_filled_cache():
    model = tiny_model()
    ids = prompt(20, B=2)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = kv_hf.compressed_cache(model, knorm(0.5))
    with pytest.raises(ValueError, match="unpadded"):
        kv_hf.prefill(model, cache, ids, mask, chunk_size=4, compress_chunks=True)
    glob = kv_hf.compressed_cache(model, knorm(0.5).with_budget(granularity="global"))
    with pytest.raises(ValueError, match="global"):
        kv_hf.prefill(model, glob, prompt(20), chunk_size=4, compress_chunks=True)
    filled = kv_hf.compressed_cache(model, knorm(0.5))
    kv_hf.prefill(model, filled, prompt(10))
    with pytest.raises(ValueError, match="empty cache"):
        kv_hf.prefill(model, filled, prompt(10), chunk_size=4, compress_chunks=True)


def test_decoding_after_a_chunked_prefill_continues_at_the_true_position():
    model, ids = tiny_model(), prompt(30)
    cache, logits = _chunked(model, streaming_llm(0.5, n_sink=2), ids, 8)
    assert int(cache.next_positions()[0]) == 30
    nxt = logits.argmax(-1, keepdim=True)
    out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
    assert torch.isfinite(out.logits).all()
    assert cache.get_seq_length() == 31
    assert int(cache.next_positions()[0]) == 31
