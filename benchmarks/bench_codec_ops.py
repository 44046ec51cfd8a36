"""Small decode-time operations on CPU, each next to the formulation it replaced, in one run.

* ``segment_ids``: kvcodec's ``repeat_interleave(counts)`` vs the earlier ``searchsorted`` over the cumulative counts;
* 3-bit unpack: kvcodec's ``unpack_unchecked`` (each 8-code chunk OR-ed into an int32 word) vs the earlier int64
  shift-and-sum;
* HqeKV ``attend`` at SmolLM2's layer shape (3 KV heads, 9 query heads, d 64, HqeKV-3.2, float32): the store's CPU
  path (``kv_hqekv.part_attention``) vs the fused kernel's PyTorch reference over per-entry maps
  (``tiered_sides`` + ``tiered_attention_ref``).

    OMP_NUM_THREADS=1 python benchmarks/bench_codec_ops.py
"""

from __future__ import annotations

import platform
import time

import torch
import torch.nn.functional as F

from kvcodec.packing import pack_unchecked, unpack_unchecked
from kvcodec.segments import segment_ids


def timeit(fn, repeat: int = 50) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1e6


def segment_ids_searchsorted(counts: torch.Tensor) -> torch.Tensor:
    ends = torch.cumsum(counts.long(), 0)
    total = int(ends[-1]) if counts.numel() else 0
    return torch.searchsorted(ends, torch.arange(total), right=True)


def unpack3_int64(packed: torch.Tensor, d: int) -> torch.Tensor:
    *lead, width = packed.shape
    chunks = -(-d // 8)
    p = F.pad(packed, (0, chunks * 3 - width)).reshape(*lead, chunks, 3).to(torch.int64)
    word = (p << (torch.arange(3, dtype=torch.int64) * 8)).sum(-1)
    codes = ((word[..., None] >> (torch.arange(8, dtype=torch.int64) * 3)) & 7).to(torch.uint8)
    return codes.view(*lead, chunks * 8)[..., :d]


def main() -> None:
    print(f"machine: {platform.machine()} CPU, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}")
    print("| operation | shape | now µs | before µs | before / now |")
    print("|---|---|---|---|---|")
    for S, n in ((3, 1280), (120, 32), (3840, 1)):
        counts = torch.full((S,), n, dtype=torch.long)
        assert torch.equal(segment_ids(counts), segment_ids_searchsorted(counts))
        a, b = timeit(lambda: segment_ids(counts)), timeit(lambda: segment_ids_searchsorted(counts))
        print(f"| segment_ids | {S} segments x {n} | {a:.1f} | {b:.1f} | {b / a:.1f}x |")
    for rows, d in ((6000, 64), (6000, 128)):
        codes = torch.randint(0, 8, (rows, d), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        packed = pack_unchecked(codes, 3)
        assert torch.equal(unpack_unchecked(packed, 3, d), codes) and torch.equal(unpack3_int64(packed, d), codes)
        a, b = timeit(lambda: unpack_unchecked(packed, 3, d)), timeit(lambda: unpack3_int64(packed, d))
        print(f"| 3-bit unpack | {rows} x {d} | {a:.0f} | {b:.0f} | {b / a:.1f}x |")
    from kv_hqekv import HqeKVConfig, hqekv
    from kv_hqekv.attention import tiered_sides
    from kv_hqekv.kernels.reference import tiered_attention_ref
    from kvcore import ScoringContext

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 3, 2048, 64, generator=g), torch.randn(1, 3, 2048, 64, generator=g)
    q = torch.randn(1, 9, 20, 64, generator=g)
    store = hqekv(3.2, config=HqeKVConfig()).compress(ScoringContext(keys=k, values=v, queries=q))
    query = q[:, :, -1:]
    a = timeit(lambda: store.attend(query), 20)
    b = timeit(lambda: tiered_attention_ref(query, *tiered_sides(store), 64**-0.5), 20)
    print(f"| HqeKV-3.2 attend | SmolLM2 layer, 2,048 tokens | {a:.0f} | {b:.0f} | {b / a:.1f}x |")


if __name__ == "__main__":
    main()
