"""FastKVzip gate (Kim et al. 2026a): the vectorised gate equals a loop-based reference, its inputs do not see the
RoPE position, the artifact round-trips with its checksum, the shipped gate loads, bad inputs are refused."""

import json
import math

import pytest
import torch

import kv_baselines as kb
from kv_baselines.scorers.fastkvzip import ShippedGate, UntrainedGates, gate_features, gate_reference
from kvcore import ScoringContext


def _gate(groups=2, sinks=3, layers=3, heads=2, dim=8, seed=0):
    g = kb.FastKVzipGate.untrained(layers, heads, dim, groups=groups, seed=seed, sinks=sinks, dim=4)
    with torch.no_grad():  # move off the zero initialisation so every term matters
        gen = torch.Generator().manual_seed(seed + 1)
        for p in (g.sink_keys, g.bias, g.q_norm, g.k_norm, g.q_bias):
            p.copy_(torch.randn(p.shape, generator=gen))
    return g.eval()


@pytest.mark.parametrize(("groups", "sinks"), [(1, 0), (2, 3), (3, 1)])
def test_gate_matches_loop_reference(groups, sinks):
    g = _gate(groups, sinks)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    with torch.no_grad():
        got = g(1, k, v)
    assert got.shape == (2, 2, 5) and got.dtype == torch.float32
    assert bool(((got > 0) & (got < 1)).all())
    torch.testing.assert_close(got, gate_reference(g, 1, k, v), atol=1e-5, rtol=1e-5)


def test_all_layers_at_once_equals_each_layer():
    g = _gate()
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    x = gate_features(k[0], v[0]).expand(3, -1, -1, -1)
    with torch.no_grad():
        every = torch.sigmoid(g.logits(slice(None), x)).mean(-1)
        for layer in range(3):
            torch.testing.assert_close(every[layer], g(layer, k, v)[0])


def test_features_ignore_the_rope_rotation():
    """Keys rotated by RoPE at any position (rotate-half layout) give the same gate inputs."""
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    ang = torch.tensor([3.0, 17.0, 250.0, 1999.0])[:, None] * inv  # [T, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rotated = k * cos + torch.cat([-k[..., 4:], k[..., :4]], -1) * sin
    torch.testing.assert_close(gate_features(rotated, v), gate_features(k, v), atol=1e-5, rtol=1e-5)


def test_save_load_round_trip_and_checksum(tmp_path):
    g = _gate()
    g.model_id, g.record = "toy", {"steps": 3}
    side = g.save(tmp_path / "g.pt")
    back = kb.FastKVzipGate.load(tmp_path / "g.pt", model_id="toy")
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    torch.testing.assert_close(back(2, k, v), g(2, k, v).detach())
    assert back.record == {"steps": 3} and json.loads(side.read_text())["config"]["sinks"] == 3
    with pytest.raises(ValueError, match="not 'other'"):
        kb.FastKVzipGate.load(tmp_path / "g.pt", model_id="other")
    meta = json.loads(side.read_text())
    side.write_text(json.dumps(meta | {"sha256": "0" * 64}))
    with pytest.raises(ValueError, match="SHA-256"):
        kb.FastKVzipGate.load(tmp_path / "g.pt")
    with pytest.raises(FileNotFoundError):
        kb.FastKVzipGate.load(tmp_path / "missing.pt")


def test_shipped_gate_loads_for_smollm2():
    gate = ShippedGate().resolve(3, 64, 0)
    assert (gate.num_layers, gate.num_kv_heads, gate.head_dim) == (30, 3, 64)
    assert gate.model_id.startswith("HuggingFaceTB/SmolLM2-135M")
    assert gate.record["held_out"]["loss"] < gate.record["held_out_untrained"]["loss"]


def _ctx(heads=2, dim=8, layer=0):
    return ScoringContext(keys=torch.randn(1, heads, 5, dim), values=torch.randn(1, heads, 5, dim), layer_idx=layer)


def test_bad_inputs_are_refused():
    scorer = kb.FastKVzipScorer(_gate())
    with pytest.raises(ValueError, match="KV heads"):
        scorer.score(_ctx(heads=3))
    with pytest.raises(ValueError, match="KV heads"):
        scorer.score(_ctx(dim=16))
    with pytest.raises(ValueError, match="layers"):
        scorer.score(_ctx(layer=3))
    with pytest.raises(TypeError, match="resolve"):
        kb.FastKVzipScorer(gate=object()).score(_ctx())
    with pytest.raises(ValueError, match="no FastKVzip gate"):
        kb.FastKVzipScorer(ShippedGate("no-such-model")).score(_ctx())
    with pytest.raises(ValueError, match="dim"):
        kb.FastKVzipConfig(dim=0)
    with pytest.raises(ValueError, match="even"):
        kb.FastKVzipGate(1, 1, 7)
    with pytest.raises(ValueError, match="eps"):
        kb.FastKVzipConfig(eps=0.0)


def test_untrained_gates_follow_the_shapes_and_the_registered_method_builds():
    scorer = kb.FastKVzipScorer(UntrainedGates(seed=1))
    assert scorer.score(_ctx(heads=4, dim=16)).keys.shape == (1, 4, 5)
    c = kb.fastkvzip(0.75)
    assert c.name == "fastkvzip" and math.isclose(c.budget.ratio, 0.75) and c.budget.granularity == "global"


def test_one_head_at_a_time_equals_the_whole_layer():
    """A ragged cache is re-planned one KV head at a time (kvcore.replan passes the head in extras["kv_head"])."""
    from kvcore.replan import HEAD_EXTRA

    g = _gate()
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    whole = kb.FastKVzipScorer(g).score(ScoringContext(keys=k, values=v, layer_idx=2)).keys
    for h in range(2):
        ctx = ScoringContext(keys=k[:, h : h + 1], values=v[:, h : h + 1], layer_idx=2, extras={HEAD_EXTRA: h})
        torch.testing.assert_close(kb.FastKVzipScorer(g).score(ctx).keys, whole[:, h : h + 1])
    with pytest.raises(ValueError, match="head must index"):
        g(2, k, v, head=2)


def test_shipped_gates_compare_by_the_file_they_name():
    """Invariant: two handles on one shipped gate are equal (and hash alike) whether or not either has loaded it, so
    a scorer rebuilt from the registry equals the first; handles on different files differ."""
    loaded = ShippedGate()
    loaded.resolve(3, 64, 0)
    assert loaded == ShippedGate() and hash(loaded) == hash(ShippedGate())
    assert ShippedGate("other") != ShippedGate() and ShippedGate() != UntrainedGates()
    assert kb.FastKVzipScorer(ShippedGate()) == kb.FastKVzipScorer(loaded)
