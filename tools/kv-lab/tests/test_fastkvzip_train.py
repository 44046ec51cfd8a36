"""`kv-fastkvzip train`: the gate's fit on synthetic targets (no model) and the CLI's refusals before any model work."""

import pytest
import torch

from kv_baselines import FastKVzipGate
from kv_lab.fastkvzip.cli import main
from kv_lab.fastkvzip.train import evaluate, train


def test_train_fits_a_learnable_target():
    """Targets that a gate can express (another gate's scores): held-out loss falls and the ranking recovers."""
    torch.manual_seed(0)
    teacher = FastKVzipGate.untrained(2, 2, 8, seed=5)
    with torch.no_grad():
        teacher.bias.fill_(-2.0)
    x = torch.randn(2, 2, 600, 12)
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True))
    with torch.no_grad():
        y = torch.sigmoid(teacher.logits(slice(None), x)).mean(-1)
    gate = FastKVzipGate.untrained(2, 2, 8, seed=1)
    held = (x[:, :, 500:], y[:, :, 500:])
    before = evaluate(gate, *held)
    history = train(
        gate, x[:, :, :500], y[:, :, :500], steps=150, batch=200, held_out=held, eval_every=50, log=lambda _: None
    )
    after = history[-1]
    assert after["held_out_loss"] < before["loss"]
    assert after["held_out_recall@0.1"] > before["recall@0.1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--split", "1.5"], "--split"), (["--steps", "0"], "--steps"), (["--seq-len", "0"], "--seq-len")],
)
def test_cli_refuses_bad_options(args, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main(["train", "--out", str(tmp_path / "g.pt"), *args])
