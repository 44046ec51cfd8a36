"""``kv-sekv mine | train | eval``: train and check a SEKV router for a backbone (SEKV §3.4).

* ``mine`` tokenizes the corpus into sequences, splits them 90/10 and records the teacher's surprisal statistics
  (``<out>/data.pt``);
* ``train`` trains the router with the backbone frozen and writes ``<out>.safetensors`` + ``<out>.json``, the
  resumable checkpoint (``<out stem>.ckpt/``) and the loss curve (``<out stem>.ckpt/loss_curve.png``);
* ``eval`` reports the held-out KL and loss terms and the per-(layer, head) zoom rate (Fig. 5).

``--device`` (default ``auto``: the first GPU when torch sees one, else the CPU) places the backbone and the router;
the token sequences stay on the host and each batch is copied. ``--model smollm2`` loads SmolLM2-135M-Instruct
offline through kvbench's loader (a dependency of kv-lab); any other value is a transformers model path or id
(``AutoModelForCausalLM``). ``--corpus`` defaults to gensim's ``lee_background.cor``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from kv_sekv.config import SEKVConfig

__all__ = ["main"]


def load_model(name: str) -> tuple[Any, Any, str]:
    """``(model, tokenizer, model_id)`` in float32 eval mode: ``"smollm2"`` or a model kvbench registers
    (``kvbench --list-models``: ``smollm2-135m``, ``gemma3-270m``), loaded offline from its package; otherwise a
    transformers path or id."""
    try:
        from kvbench.models.registry import MODELS
    except ImportError:  # pragma: no cover - depends on the environment
        MODELS = {}
    key = "smollm2-135m" if name == "smollm2" else name
    if key in MODELS:
        model, tok = MODELS[key].load()
        return model.float().eval(), tok, MODEL_IDS.get(key, MODELS[key].title)
    if name == "smollm2":  # pragma: no cover - depends on the environment
        raise SystemExit("--model smollm2 needs kvbench (pip install kvbench); or pass a transformers path")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), AutoTokenizer.from_pretrained(name), name


MODEL_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}
"""The hub ids recorded in a router trained on a kvbench model (the shipped routers' ``model_id``)."""


def pick_device(name: str) -> torch.device:
    """``--device``: ``"auto"`` (CUDA when available, else the CPU) or a torch device string."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise SystemExit(f"--device must be 'auto' or a torch device such as 'cpu' or 'cuda:0', got {name!r}") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch sees no CUDA device here")
    return device


def read_corpus(path: str | None) -> str:
    if path is None:
        try:
            from gensim.test.utils import datapath
        except ImportError as err:  # pragma: no cover
            raise SystemExit("--corpus is required without gensim (its lee_background.cor is the default)") from err
        path = datapath("lee_background.cor")
    return Path(path).read_text(encoding="utf-8", errors="replace")


def _config(args: argparse.Namespace) -> SEKVConfig:
    return SEKVConfig(
        window=args.window, proj_dim=args.proj_dim, max_rank=args.max_rank, budget=args.budget, alpha=args.alpha
    )


def cmd_mine(args: argparse.Namespace) -> dict[str, Any]:
    from kv_sekv.surprisal import surprisal_from_logits

    from .data import corpus_sequences, split_sequences

    device = pick_device(args.device)  # before the model loads: a bad --device fails at once
    model, tok, model_id = load_model(args.model)
    model.to(device)
    seqs = corpus_sequences(read_corpus(args.corpus), tok, args.seq_len)
    train, held = split_sequences(seqs, 0.1, args.seed)
    hs = []
    with torch.no_grad():
        for i in range(min(seqs.shape[0], args.stats_sequences)):
            ids = seqs[i : i + 1].to(model.device)
            hs.append(surprisal_from_logits(model(ids).logits, ids)[0, 1:].cpu())
    h = torch.cat(hs)
    stats = {
        "model_id": model_id,
        "sequences": seqs.shape[0],
        "seq_len": args.seq_len,
        "train": train.shape[0],
        "held_out": held.shape[0],
        "surprisal_mean": float(h.mean()),
        "surprisal_std": float(h.std()),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"train": train, "held_out": held, "stats": stats}, out / "data.pt")
    return stats


def _data(args: argparse.Namespace, tok: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if args.data:
        d = torch.load(args.data, weights_only=False)
        return d["train"], d["held_out"]
    from .data import corpus_sequences, split_sequences

    return split_sequences(corpus_sequences(read_corpus(args.corpus), tok, args.seq_len), 0.1, args.seed)


def _train_config(args: argparse.Namespace):
    from .loop import TrainConfig

    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        eval_every=args.eval_every,
        patience=args.patience,
        monitor=args.monitor,
        split=args.split,
        local_window=args.local_window,
        seed=args.seed,
    )


def cmd_train(args: argparse.Namespace) -> dict[str, Any]:
    from kv_sekv.router import SEKVRouter

    from .loop import train_router

    device = pick_device(args.device)  # before the model loads: a bad --device fails at once
    model, tok, model_id = load_model(args.model)
    model.to(device)
    train, held = _data(args, tok)
    c = model.config
    heads = c.num_attention_heads
    router = SEKVRouter.untrained(
        c.num_hidden_layers,
        heads,
        getattr(c, "num_key_value_heads", heads) or heads,
        getattr(c, "head_dim", None) or c.hidden_size // heads,
        _config(args),
        model_id,
        seed=args.seed,
    )
    out = Path(args.out)
    if out.suffix != ".safetensors":  # `--out runs/router` writes runs/router.safetensors (+ runs/router.json)
        out = out.with_name(out.name + ".safetensors")
    ckpt = out.with_suffix(".ckpt")
    result = train_router(
        model,
        router,
        train[:, : args.seq_len],
        held[: args.eval_sequences, : args.seq_len],
        _train_config(args),
        ckpt,
        resume=not args.no_resume,
        stop_after=args.stop_after,
    )
    summary = {
        "steps": result["step"],
        "best_step": result["best_step"],
        "stopped_early": result["stopped_early"],
        "evals": result["evals"],
        "checkpoint": str(ckpt / "checkpoint.pt"),
        "loss_curve": str(ckpt / "loss_curve.png"),
    }
    if result["step"] >= args.steps or result["stopped_early"]:
        router.save(out)
        summary["router"] = str(out)
    return summary


def cmd_eval(args: argparse.Namespace) -> dict[str, Any]:
    from kv_sekv.router import SEKVRouter

    from .loop import evaluate

    device = pick_device(args.device)  # before the model loads: a bad --device fails at once
    model, tok, model_id = load_model(args.model)
    model.to(device)
    router = SEKVRouter.load(args.router)
    router.check_config(model.config)
    router.to(model.device)
    _, held = _data(args, tok)
    rates: dict[int, torch.Tensor] = {}
    terms = evaluate(model, router, held[: args.eval_sequences, : args.seq_len], _train_config(args), rates)
    return {
        "model_id": model_id,
        **terms,
        "zoom_rate": {str(k): [round(float(x), 4) for x in v] for k, v in rates.items()},
    }


def cmd_calibrate(args: argparse.Namespace) -> dict[str, Any]:
    from kv_sekv.router import SEKVRouter

    from .loop import calibrate_tau

    device = pick_device(args.device)
    model, tok, model_id = load_model(args.model)
    model.to(device)
    router = SEKVRouter.load(args.router)
    router.check_config(model.config)
    router.to(model.device)
    train, _ = _data(args, tok)
    tau = calibrate_tau(model, router, train[: args.eval_sequences, : args.seq_len], _train_config(args), args.rate)
    router.save(args.out)
    return {"model_id": model_id, "rate": args.rate, "tau_mean": float(tau.mean()), "out": args.out}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-sekv", description="Train and check SEKV routers (SEKV §3.4).")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_ in (
        ("mine", "tokenize, split and record surprisal statistics"),
        ("train", "train a router with the backbone frozen"),
        ("eval", "held-out KL and per-(layer, head) zoom rate of a router"),
        ("calibrate", "set each tau to open the gate on --rate of the training (query, span) pairs (our addition)"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument(
            "--model", default="smollm2", help="'smollm2', a kvbench model (gemma3-270m) or a transformers path / id"
        )
        s.add_argument("--corpus", default=None, help="plain-text corpus (default: gensim's lee_background.cor)")
        s.add_argument("--seq-len", type=int, default=512)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--device", default="auto", help="'auto' (CUDA when available, else CPU), 'cpu', 'cuda:0', ...")
        s.add_argument(
            "--threads",
            type=int,
            default=0,
            help="torch CPU threads (0: torch's default); 1 is the most CPU-efficient on a small shared machine",
        )
        if name == "mine":
            s.add_argument("--out", required=True, help="output folder (data.pt)")
            s.add_argument("--stats-sequences", type=int, default=4)
            continue
        s.add_argument("--data", default=None, help="data.pt written by `kv-sekv mine` (else --corpus is tokenized)")
        s.add_argument("--steps", type=int, default=300)
        s.add_argument("--batch-size", type=int, default=1)
        s.add_argument("--lr", type=float, default=1e-3)
        s.add_argument("--eval-every", type=int, default=25)
        s.add_argument("--eval-sequences", type=int, default=4)
        s.add_argument("--patience", type=int, default=4)
        s.add_argument("--monitor", choices=("total", "distill"), default="total", help="held-out early-stopping term")
        s.add_argument("--split", type=float, default=0.5)
        s.add_argument("--local-window", type=int, default=128)
        if name == "train":
            s.add_argument(
                "--out", required=True, help="router file <out>.safetensors (suffix added if missing), <out>.json"
            )
            s.add_argument("--window", type=int, default=128, help="local window w (paper: 512; ~128 for SmolLM2)")
            s.add_argument("--proj-dim", type=int, default=32)
            s.add_argument("--max-rank", type=int, default=32)
            s.add_argument("--budget", type=float, default=0.1)
            s.add_argument("--alpha", type=float, default=1.0)
            s.add_argument("--no-resume", action="store_true")
            s.add_argument("--stop-after", type=int, default=None, help="stop after N steps (checkpointed)")
        else:
            s.add_argument("--router", required=True)
        if name == "calibrate":
            s.add_argument("--rate", type=float, default=0.05, help="target open rate per (layer, head)")
            s.add_argument("--out", required=True, help="calibrated router file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads < 0:
        raise SystemExit(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        torch.set_num_threads(args.threads)
    commands = {"mine": cmd_mine, "train": cmd_train, "eval": cmd_eval, "calibrate": cmd_calibrate}
    result = commands[args.command](args)
    json.dump(result, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
