"""One collected prefill, many compressions (kv_hf.collect_prefill): each compression gives exactly the cache
kv_hf.prefill builds for that compressor, and none of them changes the collected state."""

import pytest
import torch
from kvhf_testkit import CharTokenizer, prompt, tiny_model

import kv_baselines
import kv_hf
from kv_hf.shared import collect_prefill

COMPRESSORS = {
    "knorm": lambda: kv_baselines.knorm(0.5),
    "snapkv": lambda: kv_baselines.snapkv(0.6, window=8),
    "h2o": lambda: kv_baselines.h2o(0.5),  # every prompt query
    "streaming": lambda: kv_baselines.streaming_llm(0.7, n_sink=2),
    "kivi-2": lambda: kv_baselines.kivi(bits=2, group_size=8, residual=8),
}


def _views(cache):
    out = []
    for layer in cache.layers:
        view = layer.store.read()
        out.append((view.keys, view.values, view.positions, view.logit_bias))
    return out


def _decode(model, cache, first, steps=4):
    """Greedy decode ``steps`` tokens; the logits of every step."""
    pos = cache.next_positions()[:, None]
    tok, logits = first[:, None], []
    for _ in range(steps):
        out = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True)
        logits.append(out.logits[:, -1])
        tok, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
    return torch.stack(logits)


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
@torch.no_grad()
def test_compress_equals_one_prefill_per_compressor(name):
    """For every compressor: same last logits, same held entries (keys, values, true positions), same bytes and
    the same decoded logits as kv_hf.prefill on a fresh cache."""
    model = tiny_model()
    ids = prompt(40, seed=3)
    collected = collect_prefill(model, ids)
    direct = kv_hf.compressed_cache(model, COMPRESSORS[name]())
    want_logits = kv_hf.prefill(model, direct, ids)
    shared = collected.compress(COMPRESSORS[name]())
    torch.testing.assert_close(collected.logits, want_logits, rtol=0, atol=0)
    assert shared.nbytes() == direct.nbytes()
    assert shared.get_seq_length() == direct.get_seq_length() == ids.shape[1]
    for got, want in zip(_views(shared), _views(direct)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    first = want_logits.argmax(-1)
    torch.testing.assert_close(_decode(model, shared, first), _decode(model, direct, first), rtol=0, atol=1e-6)


@torch.no_grad()
def test_compressions_leave_the_collected_state_unchanged():
    """Compressing (and decoding over) one copy never changes what the next compression starts from."""
    model = tiny_model()
    ids = prompt(33, seed=4)
    collected = collect_prefill(model, ids)
    before = [[t.clone() for t in state.pending.tensors()] for state in collected._layers]
    a = collected.compress(kv_baselines.kivi(bits=4, group_size=8, residual=8))
    _decode(model, a, collected.logits.argmax(-1), steps=3)
    b = collected.compress(kv_baselines.snapkv(0.5, window=8))
    c = collected.compress(kv_baselines.snapkv(0.5, window=8))
    for state, saved in zip(collected._layers, before):
        for t, s in zip(state.pending.tensors(), saved):
            torch.testing.assert_close(t, s, rtol=0, atol=0)
    for got, want in zip(_views(b), _views(c)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@torch.no_grad()
def test_padded_batch_and_chunked_forward_match_prefill():
    """Left-padded rows and a chunked shared forward give prefill's cache (padding never kept)."""
    model = tiny_model()
    ids = prompt(24, B=2, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    collected = collect_prefill(model, ids, mask, chunk_size=7)
    direct = kv_hf.compressed_cache(model, kv_baselines.knorm(0.5))
    want = kv_hf.prefill(model, direct, ids, mask, chunk_size=7)
    shared = collected.compress(kv_baselines.knorm(0.5))
    torch.testing.assert_close(collected.logits, want, rtol=0, atol=1e-6)
    for got, exp in zip(_views(shared), _views(direct)):
        for g, w in zip(got, exp):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


@torch.no_grad()
def test_kvzip_provider_pass_runs_once_per_configuration_and_matches_prefill(monkeypatch):
    """KVzip's reconstruction pass (a provider needing the tokenizer and context_start) runs once per prompt and
    configuration and is reused by every compressor that needs it; each global-budget selection equals
    prefill's, and each cache's compress time includes the pass."""
    import dataclasses

    from kv_hf import providers

    runs = []
    real = providers.PROVIDERS["kvzip_scores"]
    counting = dataclasses.replace(real, run=lambda *a, **k: runs.append(1) or real.run(*a, **k))
    monkeypatch.setitem(providers.PROVIDERS, "kvzip_scores", counting)
    model = tiny_model()
    tok = CharTokenizer()
    ids = prompt(28, seed=6)
    config = kv_hf.KVzipConfig(chunk_size=10, prev_tokens=3)
    collected = collect_prefill(model, ids, tokenizer=tok, context_start=3)
    for ratio in (0.5, 0.75):
        direct = kv_hf.compressed_cache(model, kv_baselines.kvzip(ratio))
        kv_hf.prefill(model, direct, ids, tokenizer=tok, context_start=3, kvzip=config)
        shared = collected.compress(kv_baselines.kvzip(ratio), kvzip=config)
        assert shared.compress_seconds > 0
        assert [s.tolist() for s in shared.seq_lengths()] == [s.tolist() for s in direct.seq_lengths()]
        for got, want in zip(_views(shared), _views(direct)):
            torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)  # the same entries kept
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    assert len(runs) == 2 + 1  # one pass per direct prefill, one for both shared compressions
    collected.compress(kv_baselines.kvzip(0.5), kvzip=kv_hf.KVzipConfig(chunk_size=7, prev_tokens=3))
    assert len(runs) == 4  # another configuration is another pass


@torch.no_grad()
def test_bad_input_is_refused_with_clear_errors():
    model = tiny_model()
    ids = prompt(12, seed=7)
    with pytest.raises(ValueError, match="chunk_size"):
        collect_prefill(model, ids, chunk_size=0)
    with pytest.raises(ValueError, match="context_start"):
        collect_prefill(model, ids, context_start=12)
    with pytest.raises(ValueError, match="input_ids"):
        collect_prefill(model, ids.float())
    collected = collect_prefill(model, ids)
    with pytest.raises(TypeError, match="unknown prefill options"):
        collected.compress(kv_baselines.knorm(0.5), kvzpi=None)
    with pytest.raises(ValueError, match="tokenizer"):  # KVzip needs one; none was given to collect_prefill
        collected.compress(kv_baselines.kvzip(0.5))
    with pytest.raises(TypeError, match="compressor"):
        collected.compress("knorm")
