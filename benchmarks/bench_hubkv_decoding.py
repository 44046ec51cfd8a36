"""HubKV's decoding-stage experiment (paper §4.3, Appendix A.1) on teacher-forced continuations.

The paper re-compresses the cache every 128 generated tokens to a fixed target length (1,024-6,144) and compares
HubKV(+FastKVZip) with FastKVZip at the same target. Here generation is replaced by teacher forcing (a cheap proxy):
each window is a short context from ``lee_background.cor`` (kvbench's evaluation stories) followed by a long
continuation fed in blocks of ``--interval`` tokens through a ``kv_hf`` cache built with
``recompress_every=interval, target_length=L`` (what ``kv_hubkv.DecodingSchedule.cache_options`` gives): after
every block, each layer holding more than ``L`` entries is re-scored and pruned back to ``L`` per head, exactly
as token-by-token decoding with the same schedule (the tokens of a block see each other and the cache as it was at
the block's start). Per window: the mean KL(full || method) over the continuation's tokens, over its tokens after
the first re-compression, and the NLL; each HubKV variant is paired with its base on the same windows
(``kvbench.stats.paired_difference``, seeded bootstrap 95 % CI). The target is per head (``--granularity``):
re-compression runs layer by layer, so a base with a global budget (KVzip, FastKVzip) is re-compressed per head.

Usage::

    OMP_NUM_THREADS=1 uv run python benchmarks/bench_hubkv_decoding.py --windows 12 --targets 512,1024 \\
        --pairs hubkv-snapkv:snapkv,hubkv-fastkvzip:fastkvzip --out decoding.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from kv_hf import compressed_cache, prefill
from kvbench.models import get_model
from kvbench.stats import paired_difference
from kvbench.tasks import continuation_split, lee_background
from kvcore import Budget
from kvcore import registry as kvregistry


def _pairs(text: str) -> list[tuple[str, str]]:
    out = []
    for item in text.split(","):
        method, sep, base = item.partition(":")
        if not sep or not method or not base:
            raise argparse.ArgumentTypeError(f"--pairs items are method:base, got {item!r}")
        out.append((method, base))
    return out


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


@torch.no_grad()
def decode_logprobs(model, tokenizer, cache, ctx: torch.Tensor, cont: torch.Tensor, interval: int) -> torch.Tensor:
    """Teacher-forced log-probabilities ``[k, V]`` of ``cont [1, k]`` after ``ctx``, fed ``interval`` tokens at a
    time (the cache re-compresses after each block when it was built with ``recompress_every=interval``)."""
    last = prefill(model, cache, ctx, tokenizer=tokenizer)
    out = [last.reshape(1, -1).float().log_softmax(-1)]
    feed = cont[:, :-1]
    for start in range(0, feed.shape[1], interval):
        block = feed[:, start : start + interval]
        pos = cache.next_positions().to(ctx.device)[:, None] + torch.arange(block.shape[1], device=ctx.device)
        logits = model(input_ids=block, past_key_values=cache, position_ids=pos, use_cache=True).logits
        out.append(logits[0].float().log_softmax(-1))
    return torch.cat(out, 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pairs", type=_pairs, default=[("hubkv-snapkv", "snapkv")], help="method:base,... (registry)")
    ap.add_argument("--targets", type=_ints, default=[512, 1024], help="target KV lengths per head")
    ap.add_argument("--interval", type=int, default=128, help="re-compress every N tokens (paper: 128)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per window")
    ap.add_argument("--continuation", type=int, default=1536, help="teacher-forced tokens per window")
    ap.add_argument("--windows", type=int, default=12)
    ap.add_argument(
        "--granularity",
        choices=("head", "layer"),
        default="head",
        help="where the target length is exact (periodic re-compression runs per layer: a global base such as "
        "KVzip / FastKVzip keeps its scores and selector but its target is per head; default: %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="JSON with per-window results")
    args = ap.parse_args(argv)
    if args.interval < 1 or args.context < 1 or args.continuation < 2 or args.windows < 1:
        ap.error("--interval, --context, --windows must be >= 1 and --continuation >= 2")
    torch.manual_seed(args.seed)
    methods = {}
    for m, b in args.pairs:
        for name in (m, b):
            if name not in methods:
                try:
                    methods[name] = kvregistry.get(name)
                except LookupError as exc:
                    ap.error(str(exc))

    model, tok = get_model(args.model).load(dtype=torch.float32, device="cpu")
    windows = list(
        continuation_split(
            lee_background(part="evaluation"), tok, args.context, args.continuation, args.windows, seed=args.seed
        )
    )
    first_recompress = {L: max(0, (L - args.context) // args.interval + 1) * args.interval for L in args.targets}
    res: dict[str, dict[str, list[float]]] = {}
    t0 = time.perf_counter()
    for w, (ctx_ids, cont_ids) in enumerate(windows):
        ctx, cont = torch.tensor([ctx_ids]), torch.tensor([cont_ids])
        ref = decode_logprobs(model, tok, compressed_cache(model, kvregistry.get("full").build()), ctx, cont, 10**9)
        for L in args.targets:
            for name, method in methods.items():
                comp = method.build(Budget(tokens=L)).with_budget(granularity=args.granularity)
                cache = compressed_cache(model, comp, recompress_every=args.interval, target_length=L)
                lp = decode_logprobs(model, tok, cache, ctx, cont, args.interval)
                kl = (ref.exp() * (ref - lp)).sum(-1)
                late = kl[first_recompress[L] :]
                r = res.setdefault(f"{name}@{L}", {"kl": [], "kl_after": [], "nll": [], "recompressions": []})
                r["kl"].append(float(kl.mean()))
                r["kl_after"].append(float(late.mean()) if late.numel() else float("nan"))
                r["nll"].append(float(-lp.gather(-1, cont[0, :, None]).mean()))
                r["recompressions"].append(int(sum(layer.recompressions for layer in cache.compressed)))
        print(f"window {w + 1}/{len(windows)} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if args.out is not None:  # partial results after every window (a long run can be cut short)
            args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "windows": res}, default=str))

    rows = []
    for L in args.targets:
        for m, b in args.pairs:
            a, z = res[f"{m}@{L}"], res[f"{b}@{L}"]
            row = {"target": L, "method": m, "base": b}
            for key in ("kl", "kl_after", "nll"):
                d = paired_difference(a[key], z[key], seed=args.seed)
                row[key] = {"method": sum(a[key]) / len(a[key]), "base": sum(z[key]) / len(z[key]), "diff": d.mean}
                row[key] |= {"low": d.low, "high": d.high, "rel": d.mean / max(row[key]["base"], 1e-12)}
            rows.append(row)
    print(
        "| target | method | base | KL method | KL base | diff [95% CI] | KL after 1st re-compression diff [95% CI] |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        k, a = r["kl"], r["kl_after"]
        print(
            f"| {r['target']} | {r['method']} | {r['base']} | {k['method']:.4f} | {k['base']:.4f} | "
            f"{k['diff']:+.4f} [{k['low']:+.4f}, {k['high']:+.4f}] ({100 * k['rel']:+.1f} %) | "
            f"{a['diff']:+.4f} [{a['low']:+.4f}, {a['high']:+.4f}] |"
        )
    if args.out is not None:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {"argv": sys.argv, "commit": commit, "machine": platform.platform(), "seconds": time.perf_counter() - t0}
        args.out.write_text(
            json.dumps(
                {"meta": meta, "args": vars(args) | {"out": str(args.out)}, "rows": rows, "windows": res},
                indent=1,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
