"""``kv-fastkvzip train``: train the FastKVzip gate of a backbone on its own KVzip scores (Fast KVzip §3).

The corpus (default: the calibration stories kvbench holds out of its evaluation windows, ``lee_background.cor``)
is cut into ``--seq-len`` token sequences and split (``--split`` held out, seeded); every sequence is prefilled with
KVzip's reconstruction pass (``kv_hf``) to record the scorer's inputs and KVzip's scores; the gate is fitted on the
training part and evaluated on the held-out part (loss, recall of KVzip's top 10 %). Writes ``--out`` (the tensors)
and its JSON sidecar (shapes, config, the training record, SHA-256), loadable with
``kv_baselines.FastKVzipGate.load``. ``--model smollm2`` gives the gate shipped in kv-baselines
(``kv_baselines/gates/smollm2-135m.pt``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kv_lab.sekv.cli import load_model, pick_device
from kv_lab.sekv.data import corpus_sequences, split_sequences

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-fastkvzip", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("train", help="collect KVzip targets and fit the gate")
    s.add_argument("--model", default="smollm2", help="'smollm2' or a transformers model path / id")
    s.add_argument("--corpus", default=None, help="plain-text file (default: kvbench's held-out calibration stories)")
    s.add_argument("--seq-len", type=int, default=512)
    s.add_argument("--max-sequences", type=int, default=None, help="use at most N sequences of the corpus")
    s.add_argument("--split", type=float, default=0.2, help="held-out share of the sequences")
    s.add_argument("--steps", type=int, default=1500)
    s.add_argument("--batch", type=int, default=1000, help="tokens per step (authors: 1,000)")
    s.add_argument("--lr", type=float, default=0.2)
    s.add_argument("--dim", type=int, default=16)
    s.add_argument("--sinks", type=int, default=16)
    s.add_argument("--groups", type=int, default=None, help="gate queries per KV head (default: the GQA group)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default="auto")
    s.add_argument("--out", required=True, help="gate file (.pt); the sidecar is written beside it (.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("seq_len", "steps", "batch", "dim"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.split < 1.0:
        raise SystemExit(f"--split must lie in (0, 1), got {args.split}")
    from kv_baselines.scorers.fastkvzip import FastKVzipConfig, FastKVzipGate
    from kv_lab.fastkvzip.train import collect, evaluate, train

    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    model, tok, model_id = load_model(args.model)
    model.to(device)
    if args.corpus is None:
        from kvbench.tasks import lee_background

        text, source = lee_background(part="calibration"), "lee_background.cor calibration stories (kvbench)"
    else:
        text, source = Path(args.corpus).read_text(), args.corpus
    seqs = corpus_sequences(text, tok, args.seq_len)
    if args.max_sequences is not None:
        seqs = seqs[: args.max_sequences]
    tr, ho = split_sequences(seqs, args.split, args.seed)
    t0 = time.perf_counter()

    def tick(i: int, n: int) -> None:
        print(f"KVzip targets {i}/{n} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    x, y = collect(model, tok, torch.cat([tr, ho]), tick)
    n_tr = tr.numel()
    xt, yt, xh, yh = x[:, :, :n_tr], y[:, :, :n_tr], x[:, :, n_tr:], y[:, :, n_tr:]
    collect_s = time.perf_counter() - t0
    cfg = model.config
    groups = args.groups or cfg.num_attention_heads // cfg.num_key_value_heads
    head_dim = x.shape[-1] * 2 // 3
    config = FastKVzipConfig(dim=args.dim, sinks=args.sinks, groups=groups)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        gate = FastKVzipGate(x.shape[0], x.shape[1], head_dim, config, model_id)
    before = evaluate(gate, xh, yh)
    history = train(gate, xt, yt, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, held_out=(xh, yh))
    gate.record = {
        "corpus": source,
        "seq_len": args.seq_len,
        "train_sequences": int(tr.shape[0]),
        "held_out_sequences": int(ho.shape[0]),
        "train_tokens": int(n_tr),
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "seed": args.seed,
        "device": str(device),
        "collect_seconds": round(collect_s, 1),
        "train_seconds": round(history[-1]["seconds"], 1),
        "held_out_untrained": before,
        "held_out": {k[len("held_out_") :]: v for k, v in history[-1].items() if k.startswith("held_out_")},
    }
    side = gate.save(args.out)
    print(f"wrote {args.out} and {side}: held-out {gate.record['held_out']} (untrained {before})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
