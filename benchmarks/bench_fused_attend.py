"""Decode attention over a KIVI-quantized cache: kvcodec's fused kernel against fp16 SDPA and dequantize + matmul.

One decode step (one query per head) over ``T`` cached tokens quantized the KIVI way (keys per channel, values per
token, group 32, 2 or 4 bits; KIVI, Liu et al. 2024, §3), Llama-3-8B's attention shape (32 query heads, 8 KV heads,
head dim 128), float16. Three ways to compute it, side by side in one run:

* ``fused``   -- :func:`kvcodec.quantized_attention` (on CUDA the Triton kernel of
  :mod:`kvcodec.kernels.triton_attention`: codes dequantized in registers, entries split across programs,
  splits merged by a second small kernel);
* ``deq+mm``  -- the KIVI authors' approach written out here: dequantize K and V to float16 (kvcodec's
  unpack + dequantize kernel), then ``softmax(q K^T) V`` as batched matrix products (GEMV for one query);
* ``sdpa``    -- ``torch.nn.functional.scaled_dot_product_attention`` over the float16 cache (no compression);
* ``layout``  -- what kv-hf decodes through: a ``KIVIStore`` (residual 128) holding the same cache in its decode
  layout, one token appended, attended by :meth:`DecodeState.attend` (on CUDA the Triton kernel of
  :mod:`kv_baselines.quant.kivi_decode_triton`: no per-entry index maps, address arithmetic only); on CUDA also
  ``layout general``, the same kernel with its aligned path off (every tile masked and byte-wise, as before that
  path existed), and ``aligned gain``, its time over ``layout``'s.

Reported per case: the median time of a call (``triton.testing.do_bench``, which clears the L2 cache before each
run, so the bytes come from device memory), the bytes the fused kernel must read (codes, scales, zeros, the
per-entry index maps and bias, the query; for ``layout`` its codes, parameters and full-precision rows) and the
rate that makes, as GB/s and as a share of the device-to-device
copy rate measured in the same run; the float16 cache's bytes and SDPA's rate; speed-ups of ``fused`` over the
other two; and the fused output's relative error against float32 attention over the dequantized cache.

``--sweep`` also times other tile sizes, tiles per program and warp counts, and prints the best.

Usage::

    python benchmarks/bench_fused_attend.py                      # CUDA: T 4k-64k, batch 1 and 8
    python benchmarks/bench_fused_attend.py --sweep --lengths 16384
    python benchmarks/bench_fused_attend.py --lengths 256 --batch 1  # CPU: the PyTorch reference, a script check
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import kvcodec  # noqa: F401
except ImportError:  # running from a checkout without the workspace installed
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root / p) for p in ("core/kvcodec/src", "core/kvcore/src", "packages/kv-baselines/src")]

from kv_baselines.quant import KIVIStore, kivi_tiers
from kvcodec import QuantizedSegment, UniformQuantizer, quantized_attention
from kvcore import Plan

HQ, HKV, D, GROUP = 32, 8, 128, 32


def timer(device: torch.device):
    """``fn -> median ms``: ``triton.testing.do_bench`` on CUDA (L2 cleared per run), wall clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

    def cpu(fn, reps: int = 5) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)

    return cpu


def copy_rate(device: torch.device, bench) -> float:
    """Device-to-device copy rate, GB/s, counting bytes read plus bytes written."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    x = torch.randn(n // 4, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / bench(lambda: y.copy_(x)) / 1e6


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def segment_bytes(seg: QuantizedSegment) -> int:
    sides = [seg.keys, seg.values]
    return sum(nbytes(s.codes, s.scales, s.zeros, s.full) for s in sides) + nbytes(
        seg.key_row, seg.key_group, seg.value_row, seg.value_group, seg.bias
    )


def deq_mm(q: torch.Tensor, kq, vq, kquant: UniformQuantizer, vquant: UniformQuantizer, scale: float):
    """The KIVI authors' approach: dequantize K and V to the cache dtype, then ``softmax(q K^T) V``."""
    k = kquant.dequantize(kq)
    v = vquant.dequantize(vq)
    B, Hq, Qn, Dh = q.shape
    qg = q.view(B, HKV, Hq // HKV * Qn, Dh)
    p = torch.softmax((qg @ k.transpose(-1, -2)).float() * scale, dim=-1).to(v.dtype)
    return (p @ v).view(B, Hq, Qn, Dh)


def layout_store(k: torch.Tensor, v: torch.Tensor, bits: int) -> KIVIStore:
    """A KIVIStore (G 32, residual 128) holding ``k``/``v`` in its decode layout (one token appended)."""
    B, H, T, _ = k.shape
    store = KIVIStore(UniformQuantizer(bits, "channel", GROUP), UniformQuantizer(bits, "token", GROUP), residual=128)
    every = torch.ones(B, H, T - 1, dtype=torch.bool, device=k.device)
    plan = Plan(kivi_tiers(every, bits, 128, "keys"), kivi_tiers(every, bits, 128, "values"))
    pos = torch.arange(T, device=k.device).expand(B, T)
    store.write(k[:, :, :-1], v[:, :, :-1], plan, pos[:, :-1])
    store.append(k[:, :, -1:], v[:, :, -1:], pos[:, -1:])
    assert store._dec is not None, "the store did not enter its decode layout"
    return store


def layout_bytes(dec) -> int:
    """Bytes the decode-layout attention reads: the used part of every buffer."""
    nG = dec.tk // dec.kinfo[1]
    return nbytes(dec.kc[..., : dec.tk], dec.ks[..., :nG], dec.kz[..., :nG], dec.kr[:, : dec.nr]) + nbytes(
        dec.vc[..., : dec.tv], dec.vs[..., : dec.tv], dec.vz[..., : dec.tv], dec.ring[:, : dec.nv]
    )


def case(B: int, T: int, bits: int, device: torch.device, dtype: torch.dtype, bench, sweep: bool) -> dict:
    gen = torch.Generator(device=device).manual_seed(T * 31 + bits * 7 + B)
    k = torch.randn(B, HKV, T, D, device=device, generator=gen).to(dtype)
    v = torch.randn(B, HKV, T, D, device=device, generator=gen).to(dtype)
    q = torch.randn(B, HQ, 1, D, device=device, generator=gen).to(dtype)
    kquant = UniformQuantizer(bits=bits, axis="channel", group_size=GROUP)
    vquant = UniformQuantizer(bits=bits, axis="token", group_size=GROUP)
    kq, vq = kquant.quantize(k), vquant.quantize(v)
    seg = QuantizedSegment.from_dense(kq, vq)
    scale = D**-0.5
    # correctness: fused output against float32 attention over the dequantized cache
    out, _ = quantized_attention(q, seg, scale)
    kd, vd = kquant.dequantize(kq).float(), vquant.dequantize(vq).float()
    ref = F.scaled_dot_product_attention(q.float(), kd, vd, scale=scale, enable_gqa=True)
    err = float((out - ref).norm() / ref.norm())
    del kd, vd, ref
    row = dict(B=B, T=T, bits=bits, err=err)
    row["fused"] = bench(lambda: quantized_attention(q, seg, scale))
    row["deq+mm"] = bench(lambda: deq_mm(q, kq, vq, kquant, vquant, scale))
    row["sdpa"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    store = layout_store(k, v, bits)
    dec, qd = store._dec, q.view(B * HKV, HQ // HKV, D)
    lout, _ = dec.attend(qd, scale)
    view = store.read()
    kd, vd = view.keys.float(), view.values.float()
    lref = F.scaled_dot_product_attention(q.float(), kd, vd, scale=scale, enable_gqa=True)
    row["layout err"] = float((lout.view_as(lref) - lref).norm() / lref.norm())
    del view, kd, vd, lref
    store = layout_store(k, v, bits)  # read() left the decode layout
    dec = store._dec
    row["layout"] = bench(lambda: dec.attend(qd, scale))
    row["layout general"] = None
    if device.type == "cuda":
        from kv_baselines.quant.kivi_decode_triton import decode_attention_triton

        row["layout general"] = bench(lambda: decode_attention_triton(dec, qd, scale, aligned_path=False))
    row["layout bytes"] = layout_bytes(dec) + nbytes(q)
    row["bytes"] = segment_bytes(seg) + nbytes(q)
    row["fp16 bytes"] = nbytes(k, v, q)
    if sweep and device.type == "cuda":
        from kvcodec.kernels.triton_attention import quantized_attention_triton

        best = None
        for block_t in (32, 64):
            for tiles in (2, 4, 8):
                for warps in (4, 8):
                    ms = bench(
                        lambda: quantized_attention_triton(q, seg, scale, block_t=block_t, tiles=tiles, num_warps=warps)
                    )
                    if best is None or ms < best[0]:
                        best = (ms, f"block_t={block_t} tiles={tiles} warps={warps}")
        row["best"] = best
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", default=None, help="cached tokens T, comma-separated (CUDA default 4k-64k)")
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--sweep", action="store_true", help="also time other tile / split / warp settings")
    args = ap.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    lengths = [int(t) for t in (args.lengths or ("4096,16384,65536" if on_gpu else "256,1024")).split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    dtype = torch.float16 if on_gpu else torch.float32
    bench = timer(device)
    name = (
        torch.cuda.get_device_name(device)
        if on_gpu
        else f"{os.cpu_count()}-core {platform.machine()} CPU (PyTorch reference path)"
    )
    copy = copy_rate(device, bench)
    print(f"device: {name}; torch {torch.__version__}; copy rate {copy:.0f} GB/s (read + write)")
    print(f"shape: Hq={HQ} Hkv={HKV} D={D} G={GROUP}, one query per head, {str(dtype)[6:]}; median ms per call\n")
    cols = ["B", "T", "bits", "fused ms", "deq+mm ms", "sdpa ms", "fused/deq+mm", "fused/sdpa"]
    cols += ["fused MB", "fused GB/s", "% copy", "sdpa GB/s", "rel err"]
    cols += ["layout ms", "layout/sdpa", "layout MB", "layout GB/s", "layout % copy", "layout err"]
    cols += ["layout general ms", "aligned gain"]
    rows = []
    for B in batches:
        for T in lengths:
            for bits in [int(b) for b in args.bits.split(",")]:
                r = case(B, T, bits, device, dtype, bench, args.sweep)
                gbs = r["bytes"] / r["fused"] / 1e6
                lgbs = r["layout bytes"] / r["layout"] / 1e6
                rows.append(
                    [
                        B,
                        T,
                        bits,
                        f"{r['fused']:.4f}",
                        f"{r['deq+mm']:.4f}",
                        f"{r['sdpa']:.4f}",
                        f"{r['deq+mm'] / r['fused']:.2f}x",
                        f"{r['sdpa'] / r['fused']:.2f}x",
                        f"{r['bytes'] / 1e6:.1f}",
                        f"{gbs:.0f}",
                        f"{100 * gbs / copy:.0f}%",
                        f"{r['fp16 bytes'] / r['sdpa'] / 1e6:.0f}",
                        f"{r['err']:.1e}",
                        f"{r['layout']:.4f}",
                        f"{r['sdpa'] / r['layout']:.2f}x",
                        f"{r['layout bytes'] / 1e6:.1f}",
                        f"{lgbs:.0f}",
                        f"{100 * lgbs / copy:.0f}%",
                        f"{r['layout err']:.1e}",
                        "–" if r["layout general"] is None else f"{r['layout general']:.4f}",
                        "–" if r["layout general"] is None else f"{r['layout general'] / r['layout']:.2f}x",
                    ]
                )
                if "best" in r:
                    ms, cfg = r["best"]
                    print(f"B={B} T={T} bits={bits}: best {ms:.4f} ms ({cfg}; {r['bytes'] / ms / 1e6:.0f} GB/s)")
                print(" | ".join(str(v) for v in rows[-1]), flush=True)
    print("\n(speed-ups: the other method's time over fused; bytes/s over each method's own minimum reads)")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r) + " |")


if __name__ == "__main__":
    main()
