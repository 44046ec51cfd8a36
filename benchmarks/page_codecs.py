"""Stored bytes per token and CPU encode/decode throughput of the kvpages codecs (the serving layer of kv-vllm and
kv-sglang), on one page of a Llama-3-8B-shaped KV cache (all layers of one HiCache page, as SGLang stores it).

    uv run python benchmarks/page_codecs.py [--page-size 64] [--layers 32] [--heads 8] [--head-dim 128] [--repeat 3]

Bytes are exact (len of the stored blob, frame included); times are medians of --repeat runs on random normal data.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import kvpages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    P, LH, D = a.page_size, a.layers * a.heads, a.head_dim
    k, v = torch.randn(2, P, LH, D, dtype=torch.float16).unbind(0)
    fp16_per_token = 2 * LH * D * 2
    print(
        f"page: {P} tokens x {a.layers} layers x {a.heads} KV heads x {D} dims, fp16; torch {torch.__version__}, "
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    print("| codec | bytes/token | vs fp16 | encode MB/s | decode MB/s |")
    print("|---|---:|---:|---:|---:|")
    for name in ("lossless", "int8", "kivi-4", "kivi-2"):
        codec = kvpages.codec(name)
        enc, dec = [], []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            blob = codec.encode(k, v)
            enc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            codec.decode(blob)
            dec.append(time.perf_counter() - t0)
        mb = P * fp16_per_token / 1e6
        print(
            f"| {name} | {len(blob) / P:,.0f} | {fp16_per_token * P / len(blob):.2f}x | "
            f"{mb / statistics.median(enc):,.0f} | {mb / statistics.median(dec):,.0f} |"
        )


if __name__ == "__main__":
    main()
