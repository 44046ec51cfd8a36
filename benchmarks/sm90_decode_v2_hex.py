"""Instructions per KV entry of decode attention v2 over HEX's uniform segments (kv_hex.kernels.triton_folded, the
folded formulation, issue 43) against HEX's current CUDA decode kernel (kv_hex.kernels.triton_uniform: dequantize +
overlay merge in registers), compiled for sm_90 without a GPU (:mod:`sm90_compile_plugin`): Llama-3-8B's attention
shape (32 query / 8 KV heads, head dim 128, GQA group 4), float16, the prompt's segment of HEX-3 / HEX-4 (expander
overlay at ρ 3.125 %, value statistics across heads) with its residual, one query token.

Columns as :mod:`sm90_decode_v2`: the first loop's instructions per trip (fewest-most over its paths: the segment
tile loop), registers / spills, **warp instructions per entry** (``trip x warps / BLOCK_T``); the folded kernel is
also compiled with the full-row branches out (``full_rows=False``, a measurement option) to count the folded tile
alone. The overlay's ``W`` steps are a loop inside the tile that the compiler keeps: the table's "first loop" column
is then that overlay step (folded kernel) or the key overlay step (current kernel), not the tile. Read the tile from
``--verbose``'s report line: its loops in order are, for the current kernel, the key and value overlay steps, the
segment tile, the residual tile; for the folded kernel, the overlay step, the segment tile, the residual tile.

Usage (Triton 3.6, as on the device machines)::

    uv pip install --target <dir> --no-deps triton==3.6.0
    PYTHONPATH=<dir>:benchmarks python benchmarks/sm90_decode_v2_hex.py
"""

from __future__ import annotations

import argparse

import sm90_compile_plugin as sm90  # compiles instead of launching (patches Triton's JIT on import)
import torch
from sm90_decode_v2 import _loop

import kv_hex
from kv_hex.uniform import UniformCall, uniform_part
from kvcore import ScoringContext


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2016)
    ap.add_argument("--verbose", action="store_true", help="print each kernel's report line")
    args = ap.parse_args()
    sm90.SASS = True
    from kv_hex.kernels.triton_folded import uniform_decode_v2_triton
    from kv_hex.kernels.triton_uniform import uniform_attention_triton

    g = torch.Generator().manual_seed(0)
    H, Hq, D, T = 8, 32, 128, args.tokens + 5
    print(f"sm_90, Triton {sm90.triton.__version__}, float16, D {D}, {Hq}/{H} heads, {T} tokens")
    print("| bits | kernel | warps | BLOCK_T | regs / spill | loop trip (instr) | warp instr / entry |")
    print("|---|---|---|---|---|---|---|")
    for bits in (3, 4):
        k, v = torch.randn(2, 1, H, T, D, generator=g).half()
        qs = torch.randn(1, Hq, 64, D, generator=g).half()
        ctx = ScoringContext(keys=k, values=v, queries=torch.cat([qs, torch.zeros(1, Hq, T - 64, D).half()], 2))
        store = kv_hex.hex(bits).compress(ctx)
        TR = store._residual_T()
        part = uniform_part(store.config, store._segments[0])
        call = UniformCall(part, store._res["k"].view(H, TR, D), store._res["v"].view(H, TR, D), res_logits=True)
        q = torch.randn(1, Hq, 1, D, generator=g).half()
        variants = [("current (dequantize + overlay in registers)", 8, 32,
                     lambda: uniform_attention_triton(q, [call], 0.1, tensor_cores=True))]  # fmt: skip
        for warps in (4, 8):
            for full in (True, False):
                name = "v2 folded" + ("" if full else ", full-row branches out")
                variants.append((name, warps, 32, lambda w=warps, f=full: uniform_decode_v2_triton(
                    q, [call], 0.1, num_warps=w, tensor_cores=True, full_rows=f)))  # fmt: skip
        for name, warps, bt, fn in variants:
            sm90.REPORT.clear()
            try:
                fn()
            except Exception as e:  # the plugin returns nothing to merge: the report is what counts
                if not sm90.REPORT:
                    print(f"| {bits} | {name} | {warps} | {bt} | FAIL {type(e).__name__}: {str(e)[:120]} | | |")
                    continue
            rep = next((v for key, v in sm90.REPORT.items() if "merge" not in key), "")
            lo, hi, _ = _loop(rep)
            res = " ".join(x for x in rep.split("|")[0].split() if x.startswith(("REG", "STACK")))
            per = f"{lo * warps / bt:.0f}-{hi * warps / bt:.0f}"
            print(f"| {bits} | {name} | {warps} | {bt} | {res} | {lo}-{hi} | {per} |")
            if args.verbose or rep.startswith("FAIL"):
                print(f"|   {rep[:400]} |")


if __name__ == "__main__":
    main()
