"""Host reads of tensor values per decode step (each one a host sync on a GPU): the full cache through kv_hf makes
none once its layout is known, with the per-step value checks off as on a GPU."""

from __future__ import annotations

import torch
from kvhf_testkit import full_compressor, prompt, tiny_model

import kv_hf
from kvcore import value_checks
from kvcore.testing.host_reads import HostReads


@torch.no_grad()
def _decode(model, cache, tok, steps: int) -> list[torch.Tensor]:
    logits = []
    pos = cache.next_positions()[:, None]
    for _ in range(steps):
        out = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True)
        tok, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
        logits.append(out.logits[:, -1])
    return logits


@torch.no_grad()
def test_full_cache_decode_steps_make_no_host_reads():
    model = tiny_model("llama")
    cache = kv_hf.compressed_cache(model, full_compressor())
    tok = kv_hf.prefill(model, cache, prompt(20, seed=4)).argmax(-1)[:, None]
    with value_checks(False):
        _decode(model, cache, tok, 2)  # learns each layer's layout (one read per layer, once)
        with HostReads(sites=True) as reads:
            _decode(model, cache, tok, 5)
    # no growth of the reserved slots happens in these steps (DenseStore reserves 64 per head)
    assert reads.total == 0, dict(reads.by_site)


@torch.no_grad()
def test_the_same_decode_with_value_checks_reads_and_agrees():
    """The reads the GPU default skips are the value checks only: with them on, the logits are the same."""
    model = tiny_model("llama")
    logits = {}
    for checks in (False, True):
        cache = kv_hf.compressed_cache(model, full_compressor())
        tok = kv_hf.prefill(model, cache, prompt(20, seed=4)).argmax(-1)[:, None]
        with value_checks(checks), HostReads() as reads:
            logits[checks] = torch.stack(_decode(model, cache, tok, 4))
        if checks:
            assert reads.total >= 4 * len(cache.layers)  # at least one per layer and step
    torch.testing.assert_close(logits[False], logits[True], rtol=0, atol=0)
