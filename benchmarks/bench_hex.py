"""HEX (kv-hex): bytes held vs the theoretical size, and expander mask generation time, for real models' shapes.

One run prints two tables:

* **bytes** -- one layer of fp16 K/V (random values; bytes do not depend on them) written through ``kv_hex.hex(b)``'s
  plan into a ``HEXStore``, for SmolLM2-135M (3 KV heads × 64) and LLaMA-3-8B (8 × 128) shapes: ``nbytes()`` as
  a fraction of the fp16 cache, the same without int32 positions / counts ("payload"), and the theoretical fraction
  from HEX's layout (no metadata): full-precision tokens at 16 bits; coded tokens at ``b`` bits + the overlay's
  ``16·ρ`` + the value statistics' ``32 / (H·d_h)`` per element; key statistics ``32 / n`` per element. The paper
  reports 25.35 % (HEX-3) and 31.50 % (HEX-4) without a formula (Table 1).
* **masks** -- cold generation time of the Ramanujan-checked expander masks (draw + SVD check), tries and σ₂ against
  the bound, for one block (96) and longer prefill segments.

Kernel speed is not measured here: the fused decode-attention kernel over codes is not built, and the Triton
kernels that exist (prefill column sums, masked KCVT statistics) have only been run under Triton's interpreter.

Usage::

    python benchmarks/bench_hex.py
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

import kv_hex
from kv_hex import HEXConfig, HEXStore
from kv_hex.expander import expander_mask
from kvcore import Plan, Scores

SHAPES = {"SmolLM2-135M": (3, 64), "LLaMA-3-8B": (8, 128)}


def theoretical(cfg: HEXConfig, n: int, H: int, D: int) -> float:
    full = min(n, cfg.heavy_count(n) + cfg.recent) / n
    coded = (cfg.bits + 16 * cfg.rho + 32 / (H * D)) / 16
    return full + (1 - full) * coded + 2 / n


def bytes_table(lengths: list[int]) -> None:
    print("| model | bits | tokens | nbytes | % of fp16 | payload % | theoretical % |")
    print("|---|---|---|---|---|---|---|")
    for model, (H, D) in SHAPES.items():
        for bits in (3, 4):
            for n in lengths:
                comp = kv_hex.hex(bits)
                cfg = comp.new_store().config
                x = torch.randn(1, H, n, D, dtype=torch.float16)
                plan = comp.selector.select(Scores(torch.zeros(1, H, n)), comp.budget)
                assert isinstance(plan, Plan)
                store = HEXStore(cfg)
                store.write(x, x, plan, torch.arange(n)[None])
                r = store.memory_report()
                print(
                    f"| {model} | {bits} | {n} | {r['nbytes']} | {100 * r['fraction_of_fp16']:.2f} | "
                    f"{100 * r['payload_fraction_of_fp16']:.2f} | {100 * theoretical(cfg, n, H, D):.2f} |"
                )


def mask_table(lengths: list[int]) -> None:
    print("| d (channels) | n (tokens) | d1 | d2 | σ2 | bound | tries | seconds | table bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for _model, (H, D) in SHAPES.items():
        for n in lengths:
            expander_mask.cache_clear()
            t0 = time.perf_counter()
            t = expander_mask(n, H * D, 0.03125)
            dt = time.perf_counter() - t0
            spec = f"{t.d1} | {t.d2} | {t.sigma2:.3f} | {t.bound:.3f} | {t.tries}"
            print(f"| {H * D} | {n} | {spec} | {dt:.3f} | {t.nbytes} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="96,960,1920")
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    torch.manual_seed(0)
    print(f"machine: {platform.machine()} {platform.processor() or ''} cpus={os.cpu_count()} torch={torch.__version__}")
    print(f"load average: {os.getloadavg()}")
    bytes_table(lengths)
    print()
    mask_table(lengths)


if __name__ == "__main__":
    main()
