"""Issue 43, goal 1: decode attention v2 (the folded formulation, :mod:`kvcodec.kernels.triton_decode_v2`) over KIVI's
packed decode layout against fp16 SDPA and the decode-layout kernel it is to replace, Llama-3-8B's attention shape
(32 query / 8 KV heads, head dim 128), float16, KIVI's group 32 and residual 128, one query per head.

Per case (batch ``B``, cached tokens ``T``, bits): the median time of a call (``triton.testing.do_bench``, L2 cleared
per run) of

* ``sdpa`` -- ``torch.nn.functional.scaled_dot_product_attention`` over the float16 cache (GQA by ``enable_gqa``);
* ``v1``   -- :func:`kv_baselines.quant.kivi_decode_triton.decode_attention_triton` (exact dequantization, what
  ``KIVIStore.attend`` runs today);
* ``v2``   -- :func:`kvcodec.kernels.triton_decode_v2.kivi_decode_v2_triton` (and ``v2 1q``: one float16 part of
  the folded query, ``key_split=False``);

the speed-ups over SDPA (the goal: KIVI-4 >= 2.0x at B >= 8, T >= 16k and >= 1.5x at B = 1, T >= 32k; KIVI-2 >= 2.5x
at B >= 8, T >= 16k), the bytes ratio (the ceiling: fp16 bytes over the layout's bytes), the fraction of that
ceiling v2 reaches, its rate as a share of the device-to-device copy rate measured in the same run, and v2's
contract errors (docs/protocols.md: ratios <= 1 meet it) on the B = 1 case.

Usage::

    python benchmarks/bench_decode_v2.py                         # CUDA: the goal's grid
    python benchmarks/bench_decode_v2.py --lengths 4096 --batch 1 --bits 2   # a quick check
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fused_attend import HKV, HQ, D, copy_rate, layout_bytes, layout_store, nbytes, timer

from kvcodec.decode_v2 import PackedKIVI, contract_errors

GOAL = {(4, "B>=8"): 2.0, (4, "B=1"): 1.5, (2, "B>=8"): 2.5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768,65536")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--bits", default="4,2")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        print("bench_decode_v2 times CUDA kernels: no GPU here, nothing to time")
        return
    from kv_baselines.quant.kivi_decode_triton import decode_attention_triton
    from kvcodec.kernels.triton_decode_v2 import kivi_decode_v2_triton

    bench = timer(dev)
    rate = copy_rate(dev, bench)
    commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or "?"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {platform.python_version()}, commit {commit}, "
          f"copy rate {rate:.0f} GB/s")  # fmt: skip
    print("| B | T | bits | sdpa ms | v1 ms | v2 ms | v2 1q ms | v1 / sdpa | v2 / sdpa | goal | bytes ratio | "
          "of ceiling | of copy rate | contract out / lse |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for bits in (int(b) for b in args.bits.split(",")):
        for B in (int(b) for b in args.batch.split(",")):
            for T in (int(t) for t in args.lengths.split(",")):
                print(case(B, T, bits, dev, bench, rate, decode_attention_triton, kivi_decode_v2_triton))
                torch.cuda.empty_cache()


def case(B, T, bits, dev, bench, rate, v1, v2) -> str:
    """One row of the table."""
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(T + bits + B)
    k = torch.randn(B, HKV, T, D, device=dev, generator=gen, dtype=torch.float16)
    v = torch.randn(B, HKV, T, D, device=dev, generator=gen, dtype=torch.float16)
    q = torch.randn(B, HQ, 1, D, device=dev, generator=gen, dtype=torch.float16)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    dec = layout_store(k, v, bits)._dec
    cache = PackedKIVI.of_state(dec)
    qs = q.view(B * HKV, HQ // HKV, D)
    t_v1 = bench(lambda: v1(dec, qs, scale))
    t_v2 = bench(lambda: v2(qs, cache, scale))
    t_v2a = bench(lambda: v2(qs, cache, scale, key_split=False))
    fp16 = 2 * B * HKV * T * D * 2
    lay = layout_bytes(dec) + nbytes(q)
    ceiling = fp16 / lay
    sp = t_sdpa / t_v2
    goal = GOAL.get((bits, "B>=8" if B >= 8 else "B=1")) if (16384 if B >= 8 else 32768) <= T else None
    check = ""
    if B == 1:
        out, lse = v2(qs, cache, scale)
        e = contract_errors(out.cpu(), lse.cpu(), qs.cpu(), _cpu(cache), scale)
        check = f"{e['out_ratio']:.2f} / {e['lse_ratio']:.2f}"
    return (f"| {B} | {T} | {bits} | {t_sdpa:.3f} | {t_v1:.3f} | {t_v2:.3f} | {t_v2a:.3f} | "
            f"{t_sdpa / t_v1:.2f}x | **{sp:.2f}x** | {'-' if goal is None else f'{goal}x'} | "
            f"{ceiling:.2f}x | {sp / ceiling:.0%} | {lay / t_v2 / 1e6 / rate:.0%} | {check} |")  # fmt: skip


def _cpu(cache: PackedKIVI) -> PackedKIVI:
    fields = {f: getattr(cache, f) for f in PackedKIVI.__dataclass_fields__}
    return PackedKIVI(**{f: x.cpu() if isinstance(x, torch.Tensor) else x for f, x in fields.items()})


if __name__ == "__main__":
    main()
