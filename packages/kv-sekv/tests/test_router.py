"""Router artifact: safetensors + JSON sidecar, checked on load; the deterministic untrained router."""

import json

import pytest
import torch
from sekv_testkit import SMALL, router

from kv_sekv import SEKVConfig, SEKVRouter, ShippedRouter, sekv


def test_untrained_is_deterministic_semi_orthogonal_and_saturating():
    a, b = router(seed=3, gate_bias=4.0), router(seed=3, gate_bias=4.0)
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y)
    W = a.W.detach()
    eye = torch.eye(W.shape[2])
    torch.testing.assert_close(W @ W.transpose(-1, -2), eye.expand_as(W @ W.transpose(-1, -2)), atol=1e-5, rtol=0)
    assert bool((a.tau == SMALL.tau_init).all())
    gates = a.gates(torch.rand(3, 5), torch.randn(3, SMALL.proj_dim), False)
    torch.testing.assert_close(gates, torch.full((3, 5), torch.sigmoid(torch.tensor(4.0)).item()))
    assert sum(p.numel() for p in a.gate.parameters()) < 100_000  # "< 0.1M" (§3.4)


def test_save_load_roundtrip_and_checks(tmp_path):
    r = router(seed=1, gate_bias=2.0)
    side = r.save(tmp_path / "r.safetensors")
    meta = json.loads(side.read_text())
    assert meta["num_heads"] == 4 and meta["config"]["proj_dim"] == SMALL.proj_dim and len(meta["sha256"]) == 64
    back = SEKVRouter.load(tmp_path / "r.safetensors")
    for (k, x), y in zip(r.state_dict().items(), back.state_dict().values()):
        assert torch.equal(x, y), k
    assert back.config == SMALL and back.model_id == r.model_id
    with pytest.raises(ValueError, match="not 'other'"):
        SEKVRouter.load(tmp_path / "r.safetensors", model_id="other")
    # tampered tensors
    raw = bytearray((tmp_path / "r.safetensors").read_bytes())
    raw[-1] ^= 1
    (tmp_path / "r.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="SHA-256"):
        SEKVRouter.load(tmp_path / "r.safetensors")


def test_load_refuses_shapes_that_differ_from_the_json(tmp_path):
    r = router()
    side = r.save(tmp_path / "r.safetensors")
    meta = json.loads(side.read_text())
    meta["num_heads"] = 8
    side.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="shapes"):
        SEKVRouter.load(tmp_path / "r.safetensors")
    with pytest.raises(FileNotFoundError, match="missing"):
        SEKVRouter.load(tmp_path / "nope.safetensors")


def test_bad_router_arguments():
    with pytest.raises(ValueError, match="multiple"):
        SEKVRouter(2, 3, 2, 16)
    with pytest.raises(ValueError, match="head_dim"):
        SEKVRouter(2, 4, 2, 0)
    with pytest.raises(TypeError, match="config"):
        SEKVRouter(2, 4, 2, 16, config={"alpha": 1})
    with pytest.raises(TypeError, match="router"):
        sekv(0.1, router="smollm2")


def test_shipped_router_missing_is_a_clear_error():
    c = sekv(0.1, ShippedRouter("no-such-model"), SEKVConfig())
    with pytest.raises(ValueError, match="kv-sekv train"):
        c.selector.router.resolve()
