"""Instructions per KV entry of decode attention v2 over HqeKV's mixed tiers (kv_hqekv.kernels.triton_folded, the
folded formulation over the block layout, issue 43) against HqeKV's blocked kernel (dequantize in registers),
compiled for sm_90 without a GPU (:mod:`sm90_compile_plugin`): Llama-3-8B's attention shape (32 query / 8 KV heads,
head dim 128, GQA group 4), float16, HqeKV's block of 32, a 16-row fp16 tail.

Each row is one store whose blocks all hold one tier per side (``k4/v4``: 4-bit keys and values, ...; ``mixed``: every
tier on both sides), so the kernel compiles only that tier's branches (the others are pruned at compile time) and the
loop holds that tier's folded branches and the full-precision ones (fp16 blocks, tail); the static path bounds
(fewest-most) then bracket the folded tile (fewest: no branch taken; most: every branch taken), so each is compiled
a second time with the full-precision branches out (``full_rows=False``, a measurement option): its *most* is the
folded tile exactly for a one-tier store (``k4/v4``, ``k2/v2``, ``k1/v1``, ``k2/v4``). Columns as
:mod:`sm90_decode_v2`: the tile loop's
instructions per trip (fewest-most over its paths), registers / spills, **warp instructions per entry** (``trip x
warps / 32``).

Usage (Triton 3.6, as on the device machines)::

    uv pip install --target /tmp/triton36 --no-deps triton==3.6.0
    PYTHONPATH=/tmp/triton36:benchmarks python benchmarks/sm90_decode_v2_tiers.py
"""

from __future__ import annotations

import argparse

import sm90_compile_plugin as sm90  # compiles instead of launching (patches Triton's JIT on import)
import torch
from sm90_decode_v2 import _loop

from kv_hqekv import HqeKVStore
from kvcore import FULL, Plan

TIERS = {"k4/v4": (4, 4), "k2/v2": (2, 2), "k1/v1": (1, 1), "k2/v4": (2, 4), "mixed": (None, None)}


def _store(k_tier, v_tier, H, T, D, dtype, g) -> HqeKVStore:
    G = 32
    nb = T // G
    choice = torch.tensor([FULL, 4, 2, 1], dtype=torch.uint8)

    def bits(tier):
        if tier is None:
            return choice[torch.arange(nb) % 4].repeat_interleave(G).expand(1, H, nb * G)
        return torch.full((1, H, nb * G), tier, dtype=torch.uint8)

    tail = torch.full((1, H, 16), FULL, dtype=torch.uint8)
    plan = Plan(torch.cat([bits(k_tier), tail], -1).contiguous(), torch.cat([bits(v_tier), tail], -1).contiguous())
    n = nb * G + 16
    k, v = torch.randn(2, 1, H, n, D, generator=g).to(dtype)
    store = HqeKVStore(block=G)
    store.write(k, v, plan, torch.arange(n)[None])
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    sm90.SASS = True
    from kv_hqekv.kernels.triton_attention import blocked_attention_triton
    from kv_hqekv.kernels.triton_folded import blocked_decode_v2_triton

    g = torch.Generator().manual_seed(0)
    H, Hq, D = 8, 32, 128
    print(f"sm_90, Triton {sm90.triton.__version__}, float16, D {D}, {Hq}/{H} heads, {args.tokens} tokens, G 32")
    print("| tiers | kernel | warps | regs / spill | loop trip (instr) | warp instr / entry |")
    print("|---|---|---|---|---|---|")
    for name, (kt, vt) in TIERS.items():
        store = _store(kt, vt, H, args.tokens, D, torch.float16, g)
        blocked = store.decode_layout()
        q = torch.randn(1, Hq, 1, D, generator=g).half()
        variants = [("blocked (dequantize in registers)", 4, lambda: blocked_attention_triton(q, *blocked, 0.1))]
        for warps in (4, 8):
            for full in (True, False):
                kname = "v2 folded" + ("" if full else ", full-row branches out (folded tiles only)")
                variants.append((kname, warps, lambda w=warps, f=full: blocked_decode_v2_triton(
                    q, *blocked, 0.1, num_warps=w, tensor_cores=True, asm=True, full_rows=f)))  # fmt: skip
        for kname, warps, call in variants:
            sm90.REPORT.clear()
            try:
                call()
            except Exception as e:  # the plugin returns nothing to merge: the report is what counts
                if not sm90.REPORT:
                    print(f"| {name} | {kname} | {warps} | FAIL {type(e).__name__}: {str(e)[:120]} | | |")
                    continue
            rep = next((v for k, v in sm90.REPORT.items() if "merge" not in k), "")
            lo, hi, _ = _loop(rep)
            res = " ".join(x for x in rep.split("|")[0].split() if x.startswith(("REG", "STACK")))
            per = f"{hi * warps / 32:.0f}" if "tiles only" in kname else f"{lo * warps / 32:.0f}-{hi * warps / 32:.0f}"
            print(f"| {name} | {kname} | {warps} | {res} | {lo}-{hi} | {per} |")
            if rep.startswith("FAIL"):
                print(f"|   {rep[:200]} |")


if __name__ == "__main__":
    main()
