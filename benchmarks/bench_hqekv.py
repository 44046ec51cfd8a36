"""HqeKV benchmark: decode attention (fused over packed tiers -- on CUDA through the store's block layout -- vs the
same kernel over per-entry maps rebuilt at every call vs the earlier one-call-per-tier-pair path vs
dequantize-then-SDPA vs fp16 SDPA), bytes held vs the theoretical packed size, and the re-tiering time of one period —
all in one run, ratios within the run.

    uv run python benchmarks/bench_hqekv.py --lengths 4096,16384 --device cpu

The context is compressed with the paper's 2-bit shares (Table 9, Llama) at one layer of a Llama-8B-like shape
(8 KV heads, 32 query heads, head dim 128), fp16 on CUDA, float32 on CPU.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import platform
import time

import torch

from kv_hqekv import HqeKVConfig, hqekv, requantize
from kv_hqekv.attention import tier_pair_attention, tiered_sides
from kv_hqekv.kernels import tiered_attention
from kvcore import ScoringContext, reference_attention, replan_view


def timeit(fn, repeat: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeat


def theoretical_bytes(store, D: int, G: int) -> int:
    """Codes + one (scale, zero) pair per group in the cache dtype + fp16/fp32 rows; positions excluded."""
    c = store.tier_counts()
    el = torch.finfo(store._dtype).bits // 8
    total = 0
    for side in ("keys", "values"):
        n16 = int(c[f"{side}_16"].sum())
        total += n16 * D * el
        for b in (4, 2, 1):
            n = int(c[f"{side}_{b}"].sum())
            groups = -(-n // G) * D if side == "keys" else n * -(-D // G)
            total += (n * D * b + 7) // 8 + 2 * groups * el
    return total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    B, H, Hq, D = 1, 8, 32, 128
    name = (
        torch.cuda.get_device_name()
        if dev.type == "cuda"
        else f"{platform.processor() or 'cpu'} ({torch.get_num_threads()} threads)"
    )
    print(f"device: {name}, dtype {dtype}, torch {torch.__version__}")
    cols = (
        "tokens",
        "fused attend ms",
        "per-entry maps ms",
        "tier-pair attend ms",
        "pair/fused",
        "dequant+SDPA ms",
        "fp16 SDPA ms",
        "fused/fp16",
        "held / packed",
        "held / fp16",
    )
    print("| " + " | ".join((*cols, "retier s (read view)", "retier s (window state)")) + " |")
    print("|" + "---|" * (len(cols) + 2))
    g = torch.Generator(device="cpu").manual_seed(0)
    for N in (int(x) for x in args.lengths.split(",")):
        k = torch.randn(B, H, N, D, generator=g).to(dev, dtype)
        v = torch.randn(B, H, N, D, generator=g).to(dev, dtype)
        q = torch.randn(B, Hq, 20, D, generator=g).to(dev, dtype)
        c = hqekv(2.0, config=HqeKVConfig())
        store = c.compress(ScoringContext(keys=k, values=v, queries=q))
        query = q[:, :, -1:]
        fused = timeit(lambda: store.attend(query), args.repeat)  # the block layout (taken by the warm-up call)
        maps = timeit(lambda: tiered_attention(query, *tiered_sides(store), D**-0.5), args.repeat)  # maps every call
        pair = timeit(lambda: tier_pair_attention(store, query), args.repeat)
        deq = timeit(lambda: reference_attention(store.read(), query), args.repeat)
        kk, vv = k.repeat_interleave(Hq // H, 1), v.repeat_interleave(Hq // H, 1)
        sdpa = timeit(lambda: torch.nn.functional.scaled_dot_product_attention(query, kk, vv), args.repeat)
        held = store.nbytes()
        packed = theoretical_bytes(store, D, 32)
        fp = 2 * B * H * N * D * 2  # fp16 K and V
        for _ in range(32):
            pos = int(store.read().positions.max()) + 1
            store.append(
                torch.randn(B, H, 1, D, device=dev, dtype=dtype),
                torch.randn(B, H, 1, D, device=dev, dtype=dtype),
                torch.tensor([[pos]], device=dev),
            )
        old_store = copy.deepcopy(store)  # the earlier path: score the read() view again (kvcore.replan_view)
        decode = dataclasses.replace(c, selector=c.selector.for_decoding())
        t0 = time.perf_counter()
        old_plan = replan_view(old_store, decode, queries=q)
        old_store.retier(old_plan)
        retier_old = time.perf_counter() - t0
        t0 = time.perf_counter()
        plan = requantize(store, c, q)  # scores from the window state, never read()
        retier = time.perf_counter() - t0
        same = torch.equal(plan.key_bits, old_plan.key_bits) and torch.equal(
            plan.bits_for_values, old_plan.bits_for_values
        )
        print(
            f"| {N} | {fused * 1e3:.1f} | {maps * 1e3:.1f} | {pair * 1e3:.1f} | {pair / fused:.1f}x | "
            f"{deq * 1e3:.1f} | {sdpa * 1e3:.2f} | {fused / sdpa:.1f}x | "
            f"{held / packed:.3f} | {held / fp:.3f} | {retier_old:.2f} | {retier:.2f}{'' if same else ' (differ)'} |"
        )


if __name__ == "__main__":
    main()
