"""Issue 43: the paged decode attention v2 kernel (:mod:`kvcodec.kernels.triton_decode_v2_paged`, vLLM's block pool
and block table) against the contiguous v2 kernel and fp16 SDPA over the same tokens, Llama-3-8B's attention shape
(32 query / 8 KV heads, head dim 128), float16, one query per head.

Per case (batch ``B``, tokens ``T``, bits): the median time of a call (``triton.testing.do_bench``, L2 cleared per
run) of

* ``sdpa``  -- ``torch.nn.functional.scaled_dot_product_attention`` over the float16 cache (GQA by ``enable_gqa``);
* ``v2``    -- :func:`kvcodec.kernels.triton_decode_v2.kivi_decode_v2_triton` over KIVI's contiguous decode layout
  (group 32, residual 128) of the same tokens;
* ``paged`` -- :func:`kvcodec.kernels.triton_decode_v2_paged.paged_decode_v2_triton` over 32-token blocks (one key
  group per block, as kv_vllm's packed backend) at shuffled pool positions, the open block of 1-32 tokens at full
  precision (``check=False``: no host sync, as in serving);

the speed-ups over SDPA, paged over contiguous, the paged layout's rate as a share of the device-to-device copy rate,
and its contract errors (docs/protocols.md: ratios <= 1 meet it) on the B = 1 case.

Usage::

    python benchmarks/bench_decode_v2_paged.py                         # CUDA: B 1 and 8, T 16k-64k, 4 then 2 bits
    python benchmarks/bench_decode_v2_paged.py --lengths 4096 --batch 1 --bits 2   # a quick check
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
from bench_fused_attend import HKV, HQ, D, copy_rate, layout_store, nbytes, timer

from kvcodec.decode_v2 import PackedKIVI, PagedPackedKIVI, paged_contract_errors
from kvcodec.uniform import UniformQuantizer

BLOCK = 32
"""Tokens per vLLM block (one KIVI key group)."""


def paged_cache(k: torch.Tensor, v: torch.Tensor, bits: int, seed: int = 0) -> PagedPackedKIVI:
    """``k``/``v [B, H, T, D]`` as a :class:`PagedPackedKIVI`: ``(T - 1) // BLOCK`` packed blocks per sequence at
    shuffled pool positions (keys per channel over the block, values per token in groups of 32 channels), the rest
    the open block."""
    B, H, T, _ = k.shape
    n = (T - 1) // BLOCK
    nt = T - n * BLOCK
    kq = UniformQuantizer(bits, "channel", BLOCK).quantize(k[:, :, : n * BLOCK])
    vq = UniformQuantizer(bits, "token", 32).quantize(v[:, :, : n * BLOCK])

    def blocks(x: torch.Tensor, per: int) -> torch.Tensor:  # [B, H, X, n * per] -> [B * n, H, X, per]
        return x.unflatten(-1, (n, per)).permute(0, 3, 1, 2, 4).reshape(B * n, H, x.shape[2], per)

    perm = torch.randperm(B * n, generator=torch.Generator().manual_seed(seed)).to(k.device)
    pool = {
        "kc": blocks(kq.codes.transpose(2, 3), BLOCK), "ks": blocks(kq.scales.transpose(2, 3), 1),
        "kz": blocks(kq.zeros.transpose(2, 3), 1), "vc": blocks(vq.codes.transpose(2, 3), BLOCK),
        "vs": blocks(vq.scales.transpose(2, 3), BLOCK), "vz": blocks(vq.zeros.transpose(2, 3), BLOCK),
    }  # fmt: skip
    pool = {name: torch.empty_like(x).index_copy_(0, perm, x) for name, x in pool.items()}  # logical i at perm[i]
    table = torch.zeros(B, n + 1, dtype=torch.int32, device=k.device)
    table[:, :n] = perm.view(B, n).to(torch.int32)
    tail = torch.zeros(B, H, BLOCK, D, dtype=k.dtype, device=k.device)
    tail_v = tail.clone()
    tail[:, :, :nt] = k[:, :, n * BLOCK :]
    tail_v[:, :, :nt] = v[:, :, n * BLOCK :]
    lens = torch.full((B,), T, dtype=torch.int32, device=k.device)
    return PagedPackedKIVI(
        **pool, tail_k=tail, tail_v=tail_v, block_table=table, seq_lens=lens, tail_lens=torch.full_like(lens, nt),
        kbits=bits, vbits=bits, group=BLOCK, vgroup=32,
    )  # fmt: skip


def paged_bytes(cache: PagedPackedKIVI) -> int:
    """Bytes the paged kernel reads: every pool block (all are used here), the open blocks, table and lengths."""
    return nbytes(cache.kc, cache.ks, cache.kz, cache.vc, cache.vs, cache.vz, cache.tail_k, cache.tail_v) + nbytes(
        cache.block_table, cache.seq_lens, cache.tail_lens
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="16384,32768,65536")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--bits", default="4,2")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda":
        print("bench_decode_v2_paged times CUDA kernels: no GPU here, nothing to time")
        return
    from kvcodec.kernels.triton_decode_v2 import kivi_decode_v2_triton
    from kvcodec.kernels.triton_decode_v2_paged import paged_decode_v2_triton

    bench = timer(dev)
    rate = copy_rate(dev, bench)
    commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or "?"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {platform.python_version()}, commit {commit}, "
          f"copy rate {rate:.0f} GB/s")  # fmt: skip
    print("| B | T | bits | sdpa ms | v2 ms | paged ms | v2 / sdpa | paged / sdpa | paged vs v2 | paged of copy rate | "
          "contract out / lse |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for bits in (int(b) for b in args.bits.split(",")):
        for B in (int(b) for b in args.batch.split(",")):
            for T in (int(t) for t in args.lengths.split(",")):
                print(case(B, T, bits, dev, bench, rate, kivi_decode_v2_triton, paged_decode_v2_triton))
                torch.cuda.empty_cache()


def case(B, T, bits, dev, bench, rate, v2, paged) -> str:
    """One row of the table."""
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(T + bits + B)
    k = torch.randn(B, HKV, T, D, device=dev, generator=gen, dtype=torch.float16)
    v = torch.randn(B, HKV, T, D, device=dev, generator=gen, dtype=torch.float16)
    q = torch.randn(B, HQ, 1, D, device=dev, generator=gen, dtype=torch.float16)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    cache = PackedKIVI.of_state(layout_store(k, v, bits)._dec)
    t_v2 = bench(lambda: v2(q.view(B * HKV, HQ // HKV, D), cache, scale))
    pc = paged_cache(k, v, bits)
    qp = q.view(B, HQ, D)
    t_p = bench(lambda: paged(qp, pc, scale, check=False))
    check, share = "", paged_bytes(pc) / t_p / 1e6 / rate
    if B == 1:
        out, lse = paged(qp, pc, scale)
        fields = {f: getattr(pc, f) for f in PagedPackedKIVI.__dataclass_fields__}
        cpu = PagedPackedKIVI(**{f: x.cpu() if isinstance(x, torch.Tensor) else x for f, x in fields.items()})
        e = paged_contract_errors(out.cpu(), lse.cpu(), qp.cpu(), cpu, scale)
        check = f"{e['out_ratio']:.2f} / {e['lse_ratio']:.2f}"
    return (f"| {B} | {T} | {bits} | {t_sdpa:.3f} | {t_v2:.3f} | {t_p:.3f} | {t_sdpa / t_v2:.2f}x | "
            f"**{t_sdpa / t_p:.2f}x** | {t_v2 / t_p:.2f}x | {share:.0%} | {check} |")  # fmt: skip


if __name__ == "__main__":
    main()
