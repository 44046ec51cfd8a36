"""Instructions per KV entry of decode attention v2 (kvcodec.kernels.triton_decode_v2, the folded formulation over
KIVI's packed decode layout, issue 43) against the decode-layout kernel it is to replace, compiled for sm_90 without
a GPU (:mod:`sm90_compile_plugin`): Llama-3-8B's attention shape (32 query / 8 KV heads, head dim 128, GQA group 4),
float16, KIVI's group 32 and residual 128, 2 and 4 bits.

For each variant: the machine code's tile loop (instructions one warp issues per trip, fewest-most over the loop's
two paths: the folded path of fully quantized tiles is the shorter), registers and spills, and the folded path's
**warp instructions per entry** (``trip x warps / BLOCK_T``; an entry is one token of one KV head, ``2 x 128``
elements) and **per element and thread** (``x 32 / 256``), against the issue-rate budget of the 70 % bandwidth goal
(docs/benchmarks.md: 34 warp instructions per entry at 2 bits, 56 at 4 bits on an H200).

Usage (Triton 3.6, as on the device machines)::

    uv pip install --target /tmp/triton36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/triton36:benchmarks python benchmarks/sm90_decode_v2.py
"""

from __future__ import annotations

import argparse
import re

import sm90_compile_plugin as sm90  # compiles instead of launching (patches Triton's JIT on import)
import torch

BUDGET = {2: 34, 4: 56}
"""Warp instructions per entry the 70 % goal allows on an H200 (docs/benchmarks.md, issue-rate bound)."""
_LOOP = re.compile(r"loop: (\d+) instr \((\d+) BAR, (\d+) MMA, (\d+) LDS/STS(?:, paths (\d+)-(\d+))?\)")


def _loop(report: str) -> tuple[int, int, str]:
    """(fewest, most) instructions per trip of the kernel's first loop, and the loop's description."""
    m = _LOOP.search(report)
    if not m:
        return 0, 0, report
    n = int(m.group(1))
    lo, hi = (int(m.group(5)), int(m.group(6))) if m.group(5) else (n, n)
    return lo, hi, m.group(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    args = ap.parse_args()
    sm90.SASS = True
    from bench_fused_attend import layout_store

    from kv_baselines.quant.kivi_decode_triton import decode_attention_triton
    from kvcodec.decode_v2 import PackedKIVI
    from kvcodec.kernels.triton_decode_v2 import kivi_decode_v2_triton

    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    H, Hq, D = 8, 32, 128
    print(f"sm_90, Triton {sm90.triton.__version__}, {args.dtype}, D {D}, {Hq}/{H} heads, {args.tokens} tokens")
    print("| kernel | bits | warps | BLOCK_T | regs / spill | loop trip (instr) | warp instr / entry | per element |"
          " budget / entry |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for bits in (2, 4):
        store = layout_store(*torch.randn(2, 1, H, args.tokens + 1, D, generator=g).to(dtype), bits)
        q = torch.randn(H, Hq // H, D, generator=g).to(dtype)
        cache = PackedKIVI.of_state(store._dec)
        variants = [("v1 decode layout (aligned path)", 8, 32, lambda: decode_attention_triton(
            store._dec, q, 0.1, tensor_cores=True))]  # fmt: skip
        for warps in (4, 8):
            for bt in (32,):
                for split in (True, False):
                    name = "v2 folded" + ("" if split else ", one-part q'")
                    variants.append((name, warps, bt, lambda w=warps, b=bt, s=split: kivi_decode_v2_triton(
                        q, cache, 0.1, block_t=b, num_warps=w, tensor_cores=True, asm=True, key_split=s)))  # fmt: skip
        for name, warps, bt, call in variants:
            sm90.REPORT.clear()
            call()
            rep = next((v for k, v in sm90.REPORT.items() if "decode" in k.split(" ")[0]), "")
            lo, hi, _ = _loop(rep)
            res = " ".join(x for x in rep.split("|")[0].split() if x.startswith(("REG", "STACK")))
            per_entry = lo * warps / bt
            print(f"| {name} | {bits} | {warps} | {bt} | {res} | {lo}-{hi} | {per_entry:.0f} | "
                  f"{per_entry * 32 / (2 * D):.2f} | {BUDGET[bits]} |")  # fmt: skip
            if rep.startswith("FAIL"):
                print(f"|   {rep[:200]} |")


if __name__ == "__main__":
    main()
