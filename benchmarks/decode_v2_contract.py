"""The tolerance contract of decode attention v2 (docs/protocols.md), measured: worst errors of the kernel against
attention over the codes dequantized in float32 and against attention over ``read()``'s entries, and the ratio to
the contract's allowance (<= 1 meets it), over random caches (the tests' ``make_cache``: 2 heads x 4 query rows,
D 64, key group 16, 53 entries with a 5-row key residual and a 16-row value ring, logits up to ~4x unit scale), plus
the one-part folded query's lse error (``key_split=False``, outside the contract). Runs the Triton interpreter on
CPU (the compiled kernel on a GPU).

Usage::

    python benchmarks/decode_v2_contract.py [--seeds 4]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core/kvcodec/tests"))
from test_decode_v2 import DEVICE, make_cache

from kvcodec.decode_v2 import contract_errors
from kvcodec.kernels.triton_decode_v2 import kivi_decode_v2_triton


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    print("| bits K/V | dtype | out vs float32 deq. | lse vs float32 deq. | out vs read() | lse vs read() | "
          "ratio to allowance (out / lse) | one-part q': lse vs float32 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for bits in ((2, 2), (4, 4), (8, 8), (4, 2)):
        for dtype in (torch.float16, torch.bfloat16):
            w = [0.0] * 7
            for seed in range(args.seeds):
                cache, gen = make_cache(seed, 2, 64, *bits, 16, 16, 3, 5, 16, seed, dtype)
                q = (torch.randn(2, 4, 64, generator=gen) * (1 + seed % 4)).to(DEVICE, dtype)
                e = contract_errors(*kivi_decode_v2_triton(q, cache, 0.2, block_t=16), q, cache, 0.2)
                one = kivi_decode_v2_triton(q, cache, 0.2, block_t=16, key_split=False)
                e1 = contract_errors(*one, q, cache, 0.2)
                vals = [e["out_f32"], e["lse_f32"], e["out"], e["lse"], e["out_ratio"], e["lse_ratio"], e1["lse_f32"]]
                w = [max(a, b) for a, b in zip(w, vals, strict=True)]
            print(f"| {bits[0]}/{bits[1]} | {str(dtype)[6:]} | {w[0]:.1e} | {w[1]:.1e} | {w[2]:.1e} | {w[3]:.1e} | "
                  f"{w[4]:.2f} / {w[5]:.2f} | {w[6]:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
