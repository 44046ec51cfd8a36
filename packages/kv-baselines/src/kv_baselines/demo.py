"""Demo on random tensors: bytes held before and after each baseline, for one layer.

Run: ``uv run python -m kv_baselines.demo [--tokens 4096] [--ratio 0.5]``.
"""

from __future__ import annotations

import argparse

import torch

from kv_baselines import compressors as c
from kvcore import ScoringContext


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--heads", type=int, default=8, help="KV heads (query heads = 4x)")
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.tokens, args.head_dim)
    k, v = (torch.randn(shape, generator=g, dtype=torch.float32).to(torch.float16) for _ in range(2))
    q = torch.randn(1, 4 * args.heads, 64, args.head_dim, generator=g).to(torch.float16)
    ctx = ScoringContext(k, v, queries=q)
    raw = 2 * k.numel() * k.element_size()
    methods = [
        c.full(),
        c.random(args.ratio),
        c.knorm(args.ratio),
        c.streaming_llm(args.ratio),
        c.snapkv(args.ratio),
        c.kivi(4),
        c.kivi(2),
        c.snapkv_kivi(args.ratio, 2),
    ]
    print(f"one layer: {args.heads} KV heads x {args.tokens} tokens x {args.head_dim} dims, fp16 K+V = {raw:,} bytes")
    print(f"{'method':<16}{'kept/head':>10}{'bytes held':>14}{'% of fp16':>11}")
    for m in methods:
        store = m.compress(ctx)
        kept = int(store.seq_lengths().float().mean())
        print(f"{m.name:<16}{kept:>10}{store.nbytes():>14,}{100 * store.nbytes() / raw:>10.1f}%")


if __name__ == "__main__":
    main()
