"""Router training on a tiny random Llama (§3.4): the loss decreases on a fixed batch, a resumed run reproduces an
uninterrupted one, and gradients reach W, τ and g_φ."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kv_sekv import SEKVConfig, SEKVRouter
from kv_sekv.train import TrainConfig, train_router
from kv_sekv.train.loop import losses

CONFIG = SEKVConfig(window=4, min_span=4, max_rank=4, proj_dim=8, budget=0.4, lambda_budget=0.0)


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
    )
    cfg._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(cfg).eval()


def _seqs(n=4, T=48):
    return torch.randint(3, 128, (n, T), generator=torch.Generator().manual_seed(0))


def test_gradients_reach_every_trainable_part():
    model, router = _model().requires_grad_(False), SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
    terms = losses(model, router, _seqs()[:1], TrainConfig(local_window=4), 0.1)
    terms["total"].backward()
    assert float(router.W.grad.abs().sum()) > 0 and float(router.tau.grad.abs().sum()) > 0
    assert float(router.gate.net[-1].weight.grad.abs().sum()) > 0


def test_loss_decreases_on_a_fixed_batch(tmp_path):
    """...and the backbone's weights are untouched."""
    model, router = _model(), SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    batch = _seqs(T=32)[:1]
    tc = TrainConfig(steps=5, lr=3e-2, eval_every=5, local_window=4, warmup=0.0)
    before = float(losses(model, router, batch, tc, 0.0)["total"].detach())
    train_router(model, router, batch, batch, tc, tmp_path, progress=False)
    after = float(losses(model, router, batch, tc, 0.0)["total"].detach())
    assert after < before
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert (tmp_path / "checkpoint.pt").is_file()


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    model, seqs = _model(), _seqs(T=32)
    tc = TrainConfig(steps=3, lr=1e-2, eval_every=2, local_window=4)
    straight = SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
    train_router(model, straight, seqs[:3], seqs[3:], tc, tmp_path / "a", progress=False)
    resumed = SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
    first = train_router(model, resumed, seqs[:3], seqs[3:], tc, tmp_path / "b", progress=False, stop_after=2)
    assert first["step"] == 2
    fresh = SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)  # a new process: state comes from the file
    out = train_router(model, fresh, seqs[:3], seqs[3:], tc, tmp_path / "b", progress=False)
    assert out["step"] == 3
    for (k, a), b in zip(straight.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=k)


def test_bad_train_config():
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="split"):
        TrainConfig(split=1.0)
