"""kv-vllm connector data path: stored bytes per token and save/load throughput vs a raw copy, in one run.

No vLLM needed: the benchmark drives :class:`kv_vllm.WorkerState` (what ``KVCompressConnector`` runs in each
worker) over synthetic paged layers shaped like vLLM's per-layer views, and compares each codec with the raw copy a
plain offloading connector does (gather the blocks, copy them to CPU memory; on load, copy back and scatter).

Printed per codec (lossless, kivi-4, kivi-2, int8):

* bytes stored per token per layer (the whole entry: codes, scales, zeros, framing and checksums) and the ratio
  to the same KV in fp16;
* save throughput (gather + encode + pack + store) and load throughput (get + unpack + decode + scatter) in
  fp16-equivalent MB/s, median of ``--rounds``, and each one's ratio to the raw copy.

Usage::

    python benchmarks/bench_vllm_connector.py                       # Llama-3-8B-like layer, CPU layout
    python benchmarks/bench_vllm_connector.py --device cuda --layout split_last
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import kvpages
from kv_vllm import BlockTransfer, WorkerState, gather_blocks, scatter_blocks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--blocks", type=int, default=32, help="blocks saved and loaded per round (per layer)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layout", default="cpu", choices=["cpu", "split_last"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    args = p.parse_args()
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    H, D, N, nb, L = args.kv_heads, args.head_dim, args.block_size, args.blocks, args.layers
    torch.manual_seed(0)
    layers = {f"layer{i}": torch.randn(2 * nb, H, N, 2 * D, device=dev).to(dtype) for i in range(L)}
    src_ids = list(range(nb))
    dst_ids = list(range(nb, 2 * nb))
    tokens = nb * N
    fp16_mb = 2 * 2 * tokens * H * D * L / 1e6
    print(
        f"kv-vllm connector data path: {L} layers x {nb} blocks x {N} tokens, {H} KV heads x {D}, {args.dtype}, "
        f"layout {args.layout}, device {dev}; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {torch.get_num_threads()} threads"
    )

    def raw_round() -> tuple[float, float]:
        _sync(dev)
        t0 = time.perf_counter()
        held = {}
        for name, kv in layers.items():
            k, v = gather_blocks(kv, src_ids, args.layout)
            held[name] = (k.cpu(), v.cpu())
        _sync(dev)
        t1 = time.perf_counter()
        for name, kv in layers.items():
            scatter_blocks(kv, dst_ids, held[name][0], held[name][1], args.layout)
        _sync(dev)
        return t1 - t0, time.perf_counter() - t1

    def codec_round(name: str) -> tuple[float, float, int]:
        worker = WorkerState(kvpages.codec(name), kvpages.TieredStore(1 << 34), args.layout)
        saves = [BlockTransfer(f"b{i}", i) for i in src_ids]
        loads = {"r": [BlockTransfer(f"b{i}", j) for i, j in zip(src_ids, dst_ids)]}
        _sync(dev)
        t0 = time.perf_counter()
        for lname, kv in layers.items():
            worker.save_layer(lname, kv, saves)
        worker.flush()
        _sync(dev)
        t1 = time.perf_counter()
        failed = worker.load(layers, loads)
        _sync(dev)
        assert not failed
        return t1 - t0, time.perf_counter() - t1, worker.metrics.stored_bytes

    raw = [raw_round() for _ in range(args.rounds)]
    raw_save = statistics.median(r[0] for r in raw)
    raw_load = statistics.median(r[1] for r in raw)
    head = f"{'codec':10} {'B/token/layer':>14} {'vs fp16':>8} {'save MB/s':>10} {'x raw':>6}"
    print(f"\n{head} {'load MB/s':>10} {'x raw':>6}")
    fp16_per_token = 2 * 2 * H * D
    print(
        f"{'raw copy':10} {fp16_per_token * dtype.itemsize // 2:>14} {'1.00':>8} {fp16_mb / raw_save:>10.0f} "
        f"{'1.00':>6} {fp16_mb / raw_load:>10.0f} {'1.00':>6}"
    )
    for name in ("lossless", "kivi-4", "kivi-2", "int8"):
        runs = [codec_round(name) for _ in range(args.rounds)]
        save = statistics.median(r[0] for r in runs)
        load = statistics.median(r[1] for r in runs)
        per_token = runs[0][2] / (tokens * L)
        print(
            f"{name:10} {per_token:>14.1f} {fp16_per_token / per_token:>8.2f} {fp16_mb / save:>10.0f} "
            f"{raw_save / save:>6.2f} {fp16_mb / load:>10.0f} {raw_load / load:>6.2f}"
        )
    print("\nvs fp16: fp16 bytes / stored bytes (higher = smaller); x raw: raw-copy time / codec time (< 1 = slower)")


if __name__ == "__main__":
    main()
