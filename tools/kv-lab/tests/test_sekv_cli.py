"""``kv-sekv mine | train | eval`` end to end on a tiny random Llama saved with SmolLM2's tokenizer, and the device
rules of training (§3.4): the backbone, the router and each batch on one device (``--device``; a GPU when lent)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
kvbench_models = pytest.importorskip("kvbench.models")

from lab_testkit import tiny_llama

from kv_lab.sekv import TrainConfig, train_router
from kv_lab.sekv.cli import main, pick_device
from kv_lab.sekv.loop import losses
from kv_sekv import SEKVConfig, SEKVRouter

CONFIG = SEKVConfig(window=4, min_span=4, max_rank=4, proj_dim=8, budget=0.4, lambda_budget=0.0)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama over SmolLM2's vocabulary, saved with SmolLM2's tokenizer (a transformers model path)."""
    tok = kvbench_models.load_tokenizer()
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_mine_train_eval_on_a_tiny_model(tiny_model_dir, tmp_path, capsys):
    """The three commands chain: ``mine`` writes data.pt with statistics, ``train`` (on ``--device cpu``) writes the
    router, its checkpoint and loss curve, and ``eval`` reads the router back and reports finite terms and a zoom
    rate per layer and query head."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"Sentence {i} tells of the river, the hill and {i * 7} boats." for i in range(60)))
    common = ["--model", str(tiny_model_dir), "--corpus", str(corpus), "--seq-len", "64", "--device", "cpu"]
    assert main(["mine", *common, "--out", str(tmp_path / "mined"), "--stats-sequences", "2"]) == 0
    mined = json.loads(capsys.readouterr().out)
    assert mined["sequences"] == mined["train"] + mined["held_out"] and mined["held_out"] >= 1
    assert mined["surprisal_std"] > 0
    data = str(tmp_path / "mined" / "data.pt")
    out = tmp_path / "router"
    train_args = ["--data", data, "--steps", "2", "--eval-every", "1", "--eval-sequences", "1", "--local-window", "4"]
    shape_args = ["--window", "4", "--proj-dim", "8", "--max-rank", "4", "--budget", "0.8"]
    assert main(["train", *common, *train_args, *shape_args, "--out", str(out)]) == 0
    trained = json.loads(capsys.readouterr().out)
    assert trained["steps"] == 2 and len(trained["evals"]) == 2
    assert trained["router"] == str(out.with_suffix(".safetensors")) and out.with_suffix(".safetensors").is_file()
    assert out.with_suffix(".json").is_file()
    assert (tmp_path / "router.ckpt" / "loss_curve.png").is_file()
    router = str(out.with_suffix(".safetensors"))
    eval_args = ["--data", data, "--eval-sequences", "1", "--local-window", "4", "--router", router]
    assert main(["eval", *common, *eval_args]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert all(torch.isfinite(torch.tensor(ev[k])) for k in ("total", "distill", "zoom", "recon", "budget"))
    assert sorted(ev["zoom_rate"]) == ["0", "1"] and all(len(r) == 4 for r in ev["zoom_rate"].values())


def test_device_option():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(SystemExit, match="--device must be"):
        pick_device("abacus")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            pick_device("cuda")


def test_losses_refuse_a_router_on_another_device():
    """A router left on another device than the backbone is named, not met by a device-mismatch error deep inside
    attention (``train_router`` moves it; direct ``losses`` callers must)."""
    model = tiny_llama().requires_grad_(False)
    router = SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0).to("meta")
    ids = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="router is on meta and the model on cpu"):
        losses(model, router, ids, TrainConfig(local_window=4), 0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="trains on a GPU: runs where torch sees CUDA")
def test_training_on_cuda_from_host_sequences_resumes_on_the_cpu(tmp_path):
    """On a GPU: the router moves to the model's device, batches are copied from host-held sequences, the loss
    falls on a fixed batch, and a checkpoint written there resumes with the backbone on the CPU."""
    seqs = torch.randint(3, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    tc = TrainConfig(steps=4, lr=3e-2, eval_every=2, local_window=4, warmup=0.0)
    model = tiny_llama().cuda()
    router = SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
    before = None
    out = train_router(model, router, seqs, seqs, tc, tmp_path, progress=False, stop_after=2)
    assert out["step"] == 2 and router.W.device.type == "cuda"
    before = out["history"][0]["total"]
    cpu_router = SEKVRouter.untrained(2, 4, 2, 8, CONFIG, gate_bias=0.0)
    done = train_router(tiny_llama(), cpu_router, seqs, seqs, tc, tmp_path, progress=False)
    assert done["step"] == 4 and cpu_router.W.device.type == "cpu"
    assert done["history"][-1]["total"] < before
