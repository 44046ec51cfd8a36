"""Issue 42 goal 7 / 43: one decode step of kv_vllm's packed backend for one layer, end to end on its own pool.

Llama-3-8B's attention shape (32 query / 8 KV heads, head dim 128), float16, 32-token blocks, value groups of 32.
The pool is laid out as vLLM's layer view (``[num_blocks, H, N, C]`` float16 bytes) and filled by the backend's own
packing (:meth:`kv_vllm.packed.PageFormat.pack`) at shuffled pool positions; each request's open block (1-32 tokens)
is staged at full precision (:class:`kv_vllm.packed.OpenBlocks`). Per case (batch ``B``, tokens ``T``, bits): the
median time of

* ``sdpa``   -- ``torch.nn.functional.scaled_dot_product_attention`` over the float16 cache (the stock bound);
* ``step``   -- :func:`kv_vllm.packed.paged_attention` with ``decode="v2"``, what the backend's ``forward`` runs:
  host reads of lengths and table, the open blocks stacked from the staging, :func:`kv_vllm.packed.paged_view`
  (typed views of the pool, no copy), :func:`kvcodec.decode_v2.kivi_decode_v2_paged` (the paged Triton kernel on
  CUDA) and the copy into the output;
* ``kernel`` -- the paged kernel alone on a prebuilt view (``check=False``; CUDA only), so ``step - kernel`` is the
  backend's own overhead per layer and step;
* ``torch``  -- the previous path (``decode="torch"``: dequantize each request's packed blocks, matmul);

and the v2 step's output against the torch path's (worst relative row error, to be within docs/protocols.md's
contract: about ``OUT_RTOL`` = 2e-3 plus float16 rounding). Not timed: the packing of completed blocks (the
``pack_complete`` after the step), other layers, the model.

Usage::

    python benchmarks/bench_vllm_packed_decode.py                        # CUDA: B 1 and 8, T 4k-32k, 4 then 2 bits
    python benchmarks/bench_vllm_packed_decode.py --lengths 256 --batch 1 --bits 4   # CPU: a quick check
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
from bench_fused_attend import HKV, HQ, D, timer

from kv_vllm.packed import OpenBlocks, PageFormat, page_bytes_view, paged_attention, paged_view

BLOCK = 32
"""Tokens per vLLM block (one KIVI key group)."""
GROUP = 32
"""Value group size (channels)."""


def backend_pool(k: torch.Tensor, v: torch.Tensor, bits: int, seed: int = 0) -> dict:
    """``k``/``v [B, H, T, D]`` as the backend holds them after a decode step wrote token ``T``: ``(T - 1) // BLOCK``
    packed blocks per request at shuffled pool positions, the rest staged as the open block. Returns the format, the
    pool's byte view, the staging, the block table (device), ``seq_lens`` and ``query_start_loc`` (host)."""
    B, H, T, _ = k.shape
    dev, dt = k.device, k.dtype
    n = (T - 1) // BLOCK
    fmt = PageFormat(BLOCK, H, D, dt, bits, GROUP)
    nb = B * (n + 1)
    pool = torch.zeros(nb, H, BLOCK, fmt.token_bytes // k.element_size(), dtype=dt, device=dev)
    pages = page_bytes_view(pool)
    perm = torch.randperm(B * n, generator=torch.Generator().manual_seed(seed)).to(dev)
    kb = k[:, :, : n * BLOCK].unflatten(2, (n, BLOCK)).permute(0, 2, 1, 3, 4).reshape(B * n, H, BLOCK, D)
    vb = v[:, :, : n * BLOCK].unflatten(2, (n, BLOCK)).permute(0, 2, 1, 3, 4).reshape(B * n, H, BLOCK, D)
    for i in range(0, B * n, 1024):  # pack in chunks (the quantizer's temporaries)
        pages.index_copy_(0, perm[i : i + 1024], fmt.pack(kb[i : i + 1024], vb[i : i + 1024]))
    table = torch.zeros(B, n + 1, dtype=torch.int32, device=dev)
    table[:, :n] = perm.view(B, n).to(torch.int32)
    table[:, n] = torch.arange(B * n, nb, dtype=torch.int32, device=dev)  # the open blocks
    staged = OpenBlocks(H, BLOCK, D, dt)
    nt = T - n * BLOCK
    slots = torch.cat([(B * n + b) * BLOCK + torch.arange(nt) for b in range(B)])
    staged.write(
        k[:, :, n * BLOCK :].permute(0, 2, 1, 3).reshape(B * nt, H, D),
        v[:, :, n * BLOCK :].permute(0, 2, 1, 3).reshape(B * nt, H, D),
        slots,
    )
    return dict(fmt=fmt, pages=pages, staged=staged, table=table, lens=torch.full((B,), T), n=n, nt=nt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,16384,32768")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--bits", default="4,2")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bench = timer(dev)
    commit = os.popen("git rev-parse --short HEAD 2>/dev/null").read().strip() or "?"
    name = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or "cpu"
    print(f"{name}, torch {torch.__version__}, {platform.python_version()}, commit {commit}")
    print("| B | T | bits | sdpa ms | step ms | kernel ms | torch ms | step / sdpa | step - kernel ms | "
          "torch / step | step vs torch, worst row |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for bits in (int(b) for b in args.bits.split(",")):
        for B in (int(b) for b in args.batch.split(",")):
            for T in (int(t) for t in args.lengths.split(",")):
                print(case(B, T, bits, dev, bench))
                if dev.type == "cuda":
                    torch.cuda.empty_cache()


def case(B: int, T: int, bits: int, dev: torch.device, bench) -> str:
    """One row of the table."""
    scale = D**-0.5
    gen = torch.Generator(device=dev).manual_seed(T + bits + B)
    k = torch.randn(B, HKV, T, D, device=dev, generator=gen, dtype=torch.float16)
    v = torch.randn(B, HKV, T, D, device=dev, generator=gen, dtype=torch.float16)
    q = torch.randn(B, HQ, D, device=dev, generator=gen, dtype=torch.float16)
    t_sdpa = bench(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True))
    p = backend_pool(k, v, bits)
    qsl = torch.arange(B + 1)
    outs = {d: torch.empty(B, HQ * D, dtype=torch.float16, device=dev) for d in ("v2", "torch")}

    def step(decode: str):
        return paged_attention(q, p["pages"], p["staged"], p["fmt"], qsl, p["lens"], p["table"], scale, outs[decode],
                               decode=decode)  # fmt: skip

    t_step, t_torch = bench(lambda: step("v2")), bench(lambda: step("torch"))
    o2, ot = step("v2").float().view(B, HQ, D), step("torch").float().view(B, HQ, D)
    worst = float(((o2 - ot).norm(dim=-1) / ot.norm(dim=-1)).max())
    t_kernel, overhead = float("nan"), ""
    if dev.type == "cuda":
        from kvcodec.kernels.triton_decode_v2_paged import paged_decode_v2_triton

        n, nt = p["n"], p["nt"]
        opens = [p["staged"].get(int(p["table"][b, n])) for b in range(B)]
        view = paged_view(
            p["fmt"], p["pages"], torch.stack([o[0] for o in opens]), torch.stack([o[1] for o in opens]), p["table"],
            torch.full((B,), T, dtype=torch.int32, device=dev), torch.full((B,), nt, dtype=torch.int32, device=dev),
        )  # fmt: skip
        t_kernel = bench(lambda: paged_decode_v2_triton(q, view, scale, check=False))
        overhead = f"{t_step - t_kernel:.3f}"
    return (f"| {B} | {T} | {bits} | {t_sdpa:.3f} | {t_step:.3f} | {t_kernel:.3f} | {t_torch:.3f} | "
            f"{t_step / t_sdpa:.2f}x | {overhead} | {t_torch / t_step:.2f}x | {worst:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()
