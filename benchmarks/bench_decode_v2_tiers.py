"""Decode attention v2 over HqeKV's mixed tiers (kv_hqekv.kernels.triton_folded, issue 43) on a GPU: the folded
kernel vs HqeKV's blocked kernel (dequantize in registers) vs fp16 SDPA over the same tokens uncompressed, at the
issue's shape (32 query / 8 KV heads, head dim 128, float16, one decode query), T 16k and 32k, B 1 and 8; every
tier on both sides (blocks cycled fp16 / 4 / 2 / 1 bit, keys and values offset), a 16-row fp16 tail. Prints the
contract ratios (kv_hqekv.kernels.folded.contract_errors, <= 1 meets it) at B 1 and 16k. Needs CUDA.

    python benchmarks/bench_decode_v2_tiers.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from kv_hqekv import HqeKVStore
from kv_hqekv.kernels.folded import contract_errors
from kv_hqekv.kernels.triton_attention import blocked_attention_triton
from kv_hqekv.kernels.triton_folded import blocked_decode_v2_triton
from kvcore import FULL, Plan


def store_of(k: torch.Tensor, v: torch.Tensor, G: int = 32) -> HqeKVStore:
    B, H, n, _ = k.shape
    nb = (n - 16) // G
    cycle = torch.tensor([FULL, 4, 2, 1], dtype=torch.uint8, device=k.device)
    kb = cycle[torch.arange(nb, device=k.device) % 4].repeat_interleave(G)
    vb = cycle[(torch.arange(nb, device=k.device) + 1) % 4].repeat_interleave(G)
    tail = torch.full((16,), FULL, dtype=torch.uint8, device=k.device)
    plan = Plan(torch.cat([kb, tail]).expand(B, H, n).contiguous(), torch.cat([vb, tail]).expand(B, H, n).contiguous())
    store = HqeKVStore(block=G)
    store.write(k, v, plan, torch.arange(n, device=k.device).expand(B, n))
    return store


def main() -> None:
    assert torch.cuda.is_available(), "needs CUDA"
    dev = "cuda"
    H, Hq, D = 8, 32, 128
    g = torch.Generator(device=dev).manual_seed(0)
    print(torch.cuda.get_device_name(), "| float16, 32/8 heads, D 128, HqeKV G 32, tiers cycled fp16/4/2/1")
    print("| B | T | SDPA fp16 (ms) | blocked (ms) | v2 folded (ms) | v2 / SDPA | v2 / blocked |")
    print("|---|---|---|---|---|---|---|")
    for T in (16384, 32768):
        for B in (1, 8):
            n = T + 16
            k = torch.randn(B, H, n, D, device=dev, generator=g, dtype=torch.float16)
            v = torch.randn(B, H, n, D, device=dev, generator=g, dtype=torch.float16)
            q = torch.randn(B, Hq, 1, D, device=dev, generator=g, dtype=torch.float16)
            store = store_of(k, v)
            blocked = store.decode_layout()
            scale = D**-0.5
            t_sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
            t_blk = do_bench(lambda: blocked_attention_triton(q, *blocked, scale))
            t_v2 = do_bench(lambda: blocked_decode_v2_triton(q, *blocked, scale))
            print(f"| {B} | {T} | {t_sdpa:.3f} | {t_blk:.3f} | {t_v2:.3f} | {t_v2 / t_sdpa:.2f}x | "
                  f"{t_v2 / t_blk:.2f}x |")  # fmt: skip
            if B == 1 and T == 16384:
                out, lse = blocked_decode_v2_triton(q, *blocked, scale)
                print("contract:", contract_errors(out, lse, q, *blocked, scale))


if __name__ == "__main__":
    main()
