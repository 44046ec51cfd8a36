"""SEKV bytes vs context length: accelerator-resident bytes, CPU bytes of the span bases and bytes fetched per decode
step, for one attention layer with SmolLM2-135M's shapes (3 KV heads, 9 query heads, head dim 64, fp16), at a 10 %
accelerator budget, against the full cache (Eq. 16).

The keys, values and surprisal are synthetic (random; surprisal drawn from a Gamma with SmolLM2's measured mean and
spread on lee_background, μ = 3.3, σ = 3.0 nats) and the router is the deterministic untrained one, so this measures
the budget rule and the storage layout, not quality. Run: ``uv run python benchmarks/sekv_memory.py``.
"""

from __future__ import annotations

import platform
import time

import torch

from kv_sekv import SEKVConfig, SEKVRouter, sekv
from kvcore import ScoringContext

HKV, HQ, D = 3, 9, 64


def main() -> None:
    torch.manual_seed(0)
    config = SEKVConfig()
    router = SEKVRouter.untrained(1, HQ, HKV, D, config, model_id="smollm2-shapes")
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    print("| tokens | full KV (MB) | resident (MB) | resident / full | CPU bases (MB) | α used | fetched / step (MB) |")
    print("|---|---|---|---|---|---|---|")
    gamma = torch.distributions.Gamma(torch.tensor((3.3 / 3.0) ** 2), torch.tensor(3.3 / 3.0**2))
    for T in (2048, 4096, 8192):
        k = torch.randn(1, HKV, T, D).half()
        v = torch.randn(1, HKV, T, D).half()
        h = gamma.sample((1, T))
        store = sekv(0.1, router, config).compress(ScoringContext(k, v, extras={"surprisal": h}))
        full = 2 * HKV * T * D * 2
        t = time.perf_counter()
        store.attend(torch.randn(1, HQ, 1, D).half())
        step = time.perf_counter() - t
        tiers = store.bytes_by_tier()
        print(
            f"| {T} | {full / 1e6:.2f} | {tiers['resident'] / 1e6:.3f} | {tiers['resident'] / full:.3f} | "
            f"{tiers['bases'] / 1e6:.2f} | {store.alpha[0]:.2f} | {store.last_step.fetched_bytes / 1e6:.3f} "
            f"({store.last_step.expanded} spans, {step * 1e3:.0f} ms) |"
        )


if __name__ == "__main__":
    main()
