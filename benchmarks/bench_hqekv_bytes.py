"""HqeKV bytes held vs the theoretical packed size (codes + one scale/zero pair per group in the cache dtype +
fp16-tier rows), after prefill and after 40 decode appends, for one layer at the paper's Llama-8B shape and at
SmolLM2-135M's, in float32 and float16, at the paper's 2-bit shares. Deterministic (byte counts, no timing).
Run: ``uv run python benchmarks/bench_hqekv_bytes.py``.
"""

from __future__ import annotations

import torch
from bench_hqekv import theoretical_bytes

from kv_hqekv import HqeKVConfig, hqekv
from kvcore import ScoringContext

SHAPES = {"Llama-8B layer (8 KV heads, d 128)": (8, 32, 128), "SmolLM2-135M layer (3 KV heads, d 64)": (3, 9, 64)}


def main() -> None:
    print("| shape | dtype | tokens | held / packed (prefill) | held / packed (max over 40 appends) | held / fp16 |")
    print("|---|---|---|---|---|---|")
    for label, (H, Hq, D) in SHAPES.items():
        for dtype in (torch.float32, torch.float16):
            for T in (2048, 4096):
                g = torch.Generator().manual_seed(0)
                k, v = torch.randn(1, H, T, D, generator=g).to(dtype), torch.randn(1, H, T, D, generator=g).to(dtype)
                q = torch.randn(1, Hq, 20, D, generator=g).to(dtype)
                store = hqekv(2.0, config=HqeKVConfig()).compress(ScoringContext(keys=k, values=v, queries=q))
                first = store.nbytes() / theoretical_bytes(store, D, 32)
                worst = first
                for step in range(40):
                    new = [torch.randn(1, H, 1, D, generator=g).to(dtype) for _ in range(2)]
                    store.append(*new, torch.tensor([[T + step]]))
                    worst = max(worst, store.nbytes() / theoretical_bytes(store, D, 32))
                fp16 = 2 * H * (T + 40) * D * 2
                print(
                    f"| {label} | {str(dtype).removeprefix('torch.')} | {T} | {first:.3f} | {worst:.3f} | "
                    f"{store.nbytes() / fp16:.3f} |"
                )


if __name__ == "__main__":
    main()
