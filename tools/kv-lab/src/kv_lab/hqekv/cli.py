"""``kv-hqekv``: the HqeKV command line (the ratio search of Alg. 1).

``kv-hqekv search --bits 2.0 --model smollm2 --trials 200 --seed 0 --out shares.json`` searches the tier shares on
a calibration window of ``lee_background.cor`` (the corpus kvbench evaluates on) taken from its held-out
calibration stories (``kvbench.tasks.CALIBRATION_STORIES``, never in kvbench's evaluation windows) and writes a
shares file with its settings; ``kv_hqekv.hqekv(bits, shares=kv_hqekv.load_shares(path))`` uses it. The model
loader and the corpus come from ``kvbench`` and the adapter from ``kv-hf`` (kv-lab's dependencies).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kv_hqekv.shares import Shares


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kv-hqekv", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("search", help="TPE search of the tier shares at an average bit budget (Alg. 1)")
    s.add_argument("--bits", type=float, required=True, help="average code bits B_avg (Eq. 3), e.g. 2.0 or 3.2")
    s.add_argument("--model", default="smollm2", choices=["smollm2"], help="model to calibrate on")
    s.add_argument("--trials", type=int, default=200, help="TPE trials (paper: 200)")
    s.add_argument("--seed", type=int, default=0, help="TPE sampler seed")
    s.add_argument("--context", type=int, default=2048, help="calibration context tokens (compressed)")
    s.add_argument("--continuation", type=int, default=64, help="teacher-forced tokens scored against fp16")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--out", default="hqekv-shares.json", help="shares file to write")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument(
        "--code-compat", action="store_true", help="score against labels shifted by one (the authors' search code)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from kv_hqekv.compressor import hqekv
    from kv_lab.hqekv.search import full_cache_labels, prefill_cross_entropy, search_shares

    try:
        from kvbench.models import load_smollm2
        from kvbench.tasks import lee_background
    except ImportError:
        print("kv-hqekv search needs kvbench and kv-hf installed (the model loader and corpus)", file=sys.stderr)
        return 2
    model, tok = load_smollm2(dtype=getattr(torch, args.dtype))
    ids = lee_background(tok, part="calibration")
    n = args.context + args.continuation
    if len(ids) < n:
        print(
            f"the calibration stories hold {len(ids)} tokens, fewer than context + continuation = {n}", file=sys.stderr
        )
        return 2
    window = torch.tensor(ids[-n:])[None]
    ctx, cont = window[:, : args.context], window[:, args.context :]
    labels = full_cache_labels(model, ctx, cont)

    def loss(shares: Shares) -> float:
        return prefill_cross_entropy(model, ctx, cont, hqekv(args.bits, shares=shares), labels, args.code_compat)

    result = search_shares(loss, args.bits, args.trials, args.seed, progress=not args.no_progress)
    out = result.to_json()
    out["settings"].update(
        {
            "model": args.model,
            "dtype": args.dtype,
            "context": args.context,
            "continuation": args.continuation,
            "code_compat": args.code_compat,
            "calibration": "lee_background.cor calibration stories (kvbench CALIBRATION_STORIES), last "
            "context+continuation tokens",
        }
    )
    Path(args.out).write_text(json.dumps(out, indent=2))
    s = result.shares
    print(
        f"best shares at {args.bits:g} bits: 4-bit {s.q4:.4f}, 2-bit {s.q2:.4f}, 1-bit {s.q1:.4f}, evict "
        f"{s.evict:.4f} (loss {result.loss:.4f}, L_c {result.calibration_loss:.4f}) -> {args.out}"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
