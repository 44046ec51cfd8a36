"""Router training on a tiny random Llama (§3.4): the loss decreases on a fixed batch, a resumed run reproduces an
uninterrupted one, and gradients reach W, τ and g_φ."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lab_testkit import tiny_llama

from kv_lab.sekv import TrainConfig, train_router
from kv_lab.sekv.loop import losses
from kv_sekv import SEKVConfig, SEKVRouter

CONFIG = SEKVConfig(window=4, min_span=4, max_rank=4, proj_dim=8, budget=0.4, lambda_budget=0.0)


def _seqs(n=4, T=48):
    return torch.randint(3, 128, (n, T), generator=torch.Generator().manual_seed(0))


def test_gradients_reach_every_trainable_part():
    model, router = tiny_llama().requires_grad_(False), SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
    terms = losses(model, router, _seqs()[:1], TrainConfig(local_window=4), 0.1)
    terms["total"].backward()
    assert float(router.W.grad.abs().sum()) > 0 and float(router.tau.grad.abs().sum()) > 0
    assert float(router.gate.net[-1].weight.grad.abs().sum()) > 0


def test_loss_decreases_on_a_fixed_batch(tmp_path):
    """...and the backbone's weights are untouched."""
    model, router = tiny_llama(), SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
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
    model, seqs = tiny_llama(), _seqs(T=32)
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


def test_teacher_recording_keeps_the_model_output():
    """The recording attention of the teacher pass is the model's own causal attention: same logits."""
    from kv_lab.sekv import TeacherRecord, teacher_recording

    model, ids = tiny_llama(), _seqs(n=2, T=24)
    with torch.no_grad():
        plain = model(ids).logits
        rec = TeacherRecord(10)
        with teacher_recording(model, rec):
            recorded = model(ids, use_cache=False).logits
    torch.testing.assert_close(recorded, plain, rtol=1e-5, atol=1e-5)
    keys, values, queries = rec.stacked()
    assert keys.shape == (2, 2, 2, 24, 8) and values.shape == (2, 2, 2, 10, 8) and queries.shape == (2, 2, 4, 14, 8)
    assert model.config._attn_implementation == "sdpa"  # restored


@pytest.mark.parametrize("tau", [0.0, 0.999])
def test_student_at_full_resolution_is_the_teacher(tau):
    """With every span zoomed (τ = 0), unit gates and R_max = d_h, the continuation-only student pass over the
    teacher's prefix keys and values reproduces the teacher (KL ≈ 0); with no span zoomed (τ ≈ 1) the coarse entries
    replace the spans and the KL is positive."""
    cfg = SEKVConfig(window=4, min_span=4, max_rank=8, proj_dim=8, budget=0.4, tau_init=tau)
    model, router = tiny_llama(init=0.2), SEKVRouter.untrained(2, 4, 2, 8, cfg, gate_bias=30.0)  # peaked outputs
    rates: dict = {}
    with torch.no_grad():
        terms = losses(model, router, _seqs(n=2, T=48)[:2], TrainConfig(local_window=4), 0.0, rates)
    assert sorted(rates) == [0, 1] and len(rates[0]) == 2  # spans exist in both rows, in both layers
    zoomed = torch.stack([r for v in rates.values() for r in v])
    if tau == 0.0:
        assert bool((zoomed == 1).all())
        assert float(terms["distill"]) < 1e-5
        assert float(terms["recon"]) < 1e-6
    else:
        assert bool((zoomed == 0).all())
        assert float(terms["distill"]) > 1e-3


def test_zoom_targets_follow_the_teacher_attention():
    """Eq. 12 on a teacher that attends only to span 1: y marks span 1 alone, and the query is mined only when that
    span lies beyond the local window."""
    from kv_lab.sekv import zoom_targets

    c, Qc, D = 40, 3, 4
    sid = torch.full((c,), -1, dtype=torch.long)
    sid[10:20], sid[20:30] = 0, 1
    keys = torch.zeros(1, 1, c + Qc, D)
    keys[0, 0, 20:30, 0] = 10.0
    queries = torch.zeros(1, 2, Qc, D)
    queries[..., 0] = 10.0
    y, mined = zoom_targets(queries, keys, sid, 2, 1.0, local_window=4, rho=0.9)
    assert y.shape == (1, 2, Qc, 2) and mined.shape == (1, Qc)
    assert bool((y[..., 1] == 1).all()) and bool((y[..., 0] == 0).all())
    assert bool(mined.all())
    _, near = zoom_targets(queries, keys, sid, 2, 1.0, local_window=20, rho=0.9)
    assert not bool(near.any())


def test_peaked_attention_keeps_the_loss_finite():
    """Regression: with logits of hundreds (a sharp random model), the softmax shift must be the max over the terms
    that count (z is 0 or 1 in the forward pass) and the others must not overflow, else 0/0 or 0·inf gives NaN."""
    cfg = SEKVConfig(window=4, min_span=4, max_rank=4, proj_dim=8, budget=0.4, tau_init=0.999)
    model, router = tiny_llama(init=1.0), SEKVRouter.untrained(2, 4, 2, 8, cfg, gate_bias=30.0)
    terms = losses(model, router, _seqs(n=2, T=48), TrainConfig(local_window=4), 0.1)
    terms["total"].backward()
    assert all(bool(torch.isfinite(v)) for v in terms.values())
    assert bool(torch.isfinite(router.W.grad).all()) and bool(torch.isfinite(router.tau.grad).all())


@pytest.mark.parametrize("monitor", ["total", "distill"])
def test_early_stopping_keeps_the_best_monitored_step(monitor):
    """The router ends with the parameters of the evaluation with the lowest held-out ``monitor`` term."""
    from kv_lab.sekv import evaluate

    model, seqs = tiny_llama(), _seqs(T=32)
    tc = TrainConfig(steps=5, lr=5e-2, eval_every=1, patience=10, local_window=4, monitor=monitor, warmup=0.0)
    router = SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
    out = train_router(model, router, seqs[:3], seqs[3:], tc, None, progress=False)
    values = [e[monitor] for e in out["evals"]]
    assert out["best_step"] == out["evals"][values.index(min(values))]["step"]
    assert evaluate(model, router, seqs[3:], tc)[monitor] == pytest.approx(min(values), rel=1e-5)
    with pytest.raises(ValueError, match="monitor"):
        TrainConfig(monitor="zoom")


@pytest.mark.parametrize("rate", [0.1, 0.3])
def test_calibrate_tau_sets_the_open_rate(rate):
    """``calibrate_tau``: each (layer, head) then opens its gate on about ``rate`` of the calibration pairs."""
    from kv_lab.sekv.loop import calibrate_tau

    model, router = tiny_llama(), SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
    seqs, tc = _seqs(n=2, T=64), TrainConfig(local_window=4)
    tau = calibrate_tau(model, router, seqs, tc, rate)
    assert tau.shape == (2, 4) and torch.equal(router.tau.detach(), tau)
    gates: dict = {}
    with torch.no_grad():
        for i in range(2):
            losses(model, router, seqs[i : i + 1], tc, 0.1, gates=gates)
    for layer, parts in gates.items():
        opened = (torch.cat(parts, 1) > tau[layer][:, None]).float().mean(1)
        assert float((opened - rate).abs().max()) < 0.05
    with pytest.raises(ValueError, match="rate must lie"):
        calibrate_tau(model, router, seqs, tc, 1.0)
