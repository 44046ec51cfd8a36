"""The ratio search: TPE over (x3, x4) with Eq. 3, infeasible trials rejected, reproducible with a seed; and the
calibration loss on a tiny random model through kv-hf."""

import json
import math

import pytest
import torch

pytest.importorskip("optuna")

from kv_hqekv import HqeKVConfig, Shares, hqekv, load_shares
from kv_lab.hqekv.search import full_cache_labels, prefill_cross_entropy, search_shares


def test_search_finds_the_minimum_of_a_known_loss():
    """With L_c = 0 the objective is α·x3 + β·x4, minimised at x3 = x4 = 0 (all 4-/2-bit); every trial's shares
    satisfy Eq. 3, infeasible ones score +inf, and the same seed reproduces the trials."""
    r = search_shares(lambda s: 0.0, 2.0, trials=25, seed=3)
    assert len(r.trials) == 25
    for t in r.trials:
        if t["feasible"]:
            assert t["loss"] == pytest.approx(2 * t["x3"] + 4 * t["x4"])
        else:
            assert t["loss"] == math.inf
    assert r.loss == min(t["loss"] for t in r.trials)
    assert r.shares.avg_bits == pytest.approx(2.0)
    assert r.shares.q1 + r.shares.evict < 0.2
    again = search_shares(lambda s: 0.0, 2.0, trials=25, seed=3)
    assert [t["x3"] for t in again.trials] == [t["x3"] for t in r.trials]


def test_search_errors():
    with pytest.raises(ValueError, match="bits"):
        search_shares(lambda s: 0.0, 5.0, trials=2)
    with pytest.raises(TypeError, match="callable"):
        search_shares(0.0, 2.0, trials=2)
    with pytest.raises(ValueError, match="trials"):
        search_shares(lambda s: 0.0, 2.0, trials=0)


@torch.no_grad()
def test_calibration_loss_on_a_tiny_model(tmp_path):
    """16 trials (about 1 in 6 is feasible at 2 bits) on a tiny random Llama through kv-hf; shares file round trip."""
    pytest.importorskip("kv_hf")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(1))
    ctx, cont = ids[:, :176], ids[:, 176:]
    labels = full_cache_labels(model, ctx, cont)
    small = HqeKVConfig(block=8, period=8, window=4)
    full = prefill_cross_entropy(model, ctx, cont, hqekv(2.0, config=HqeKVConfig(fp16_blocks=10**6)), labels)
    r = search_shares(
        lambda s: prefill_cross_entropy(model, ctx, cont, hqekv(2.0, shares=s, config=small), labels),
        2.0,
        trials=16,
        seed=0,
    )
    assert math.isfinite(full) and math.isfinite(r.calibration_loss)
    assert r.loss == pytest.approx(r.calibration_loss + 2 * r.shares.q1 + 4 * r.shares.evict)
    assert r.shares.avg_bits == pytest.approx(2.0)
    # the loss sees the compression: an all-evicting plan is not the uncompressed cache
    assert prefill_cross_entropy(model, ctx, cont, hqekv(2.0, shares=r.shares, config=small), labels) == pytest.approx(
        r.calibration_loss
    )
    path = tmp_path / "shares.json"
    path.write_text(json.dumps(r.to_json()))
    assert load_shares(path) == Shares(**r.to_json()["shares"])


def test_code_compat_shifts_labels():
    """code_compat scores position t against the full cache's argmax at t + 1 (the authors' shifted labels)."""
    pytest.importorskip("kv_hf")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, 64, (1, 80), generator=torch.Generator().manual_seed(2))
    ctx, cont = ids[:, :64], ids[:, 64:]
    c = hqekv(2.0, config=HqeKVConfig(fp16_blocks=10**6))
    labels = full_cache_labels(model, ctx, cont)
    with torch.no_grad():
        logits = model(ids).logits[0, 64:].float()
    shifted = float(torch.nn.functional.cross_entropy(logits[:-1], labels[1:]))
    assert prefill_cross_entropy(model, ctx, cont, c, labels, code_compat=True) == pytest.approx(shifted, rel=1e-4)
    assert prefill_cross_entropy(model, ctx, cont, c, labels) == pytest.approx(
        float(torch.nn.functional.cross_entropy(logits, labels)), rel=1e-4
    )
