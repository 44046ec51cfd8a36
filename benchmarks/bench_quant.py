"""Benchmark: min-max quantize+pack and unpack+dequantize of KV tensors, three ways, with ratios.

* ``dispatch``  -- ``kvcodec.kernels`` as users get it: the fused Triton kernels on CUDA tensors (on CPU
  tensors it *is* the reference, so the column is left out there);
* ``reference`` -- our PyTorch reference (dense bit-packing of any width, exact min-max scale rule);
* ``anchor``    -- the approach of KIVI's ``quant/new_pack.py``, written here from its
  description: group min/max, ``clamp(round((x - min) / scale))`` to int32, then pack ``32/b`` codes per int32
  with a Python loop over the ``32/b`` lanes (keys packed along tokens, values along channels, as KIVI does);
  dequantize by shifting every lane out again and computing ``code * scale + min`` in the input dtype.

Every row also reports the bytes each layout holds (codes + scales + zeros) and the mean absolute error of
ours relative to the anchor's (1.0 = same accuracy).

Usage::

    python benchmarks/bench_quant.py            # B=1, H=8, T in {4096, 32768}, D=128, bits {2, 4}, both axes,
                                                # bf16 and fp32, on CUDA if available
    python benchmarks/bench_quant.py --quick    # small shapes (T in {1024, 4096}), fewer repetitions
    python benchmarks/bench_quant.py --device cpu

Ratios are ``anchor time / our time`` (above 1: we are faster), the median over rounds in which the contenders
run back to back, which keeps them meaningful on a shared machine. GPU figures must come from a real GPU run,
with the device named; the table header prints the device.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from kvcodec import kernels


# ------------------------------------------------------------------------------------------------------------
# the anchor's approach (KIVI new_pack.py style), re-implemented from its description
# ------------------------------------------------------------------------------------------------------------
def anchor_quantize_pack(x: torch.Tensor, bits: int, axis: str, group_size: int):
    """KIVI-style: per-group min-max to int32 codes, then pack 32/bits codes per int32 with a loop over lanes.

    ``axis="channel"`` (keys): groups of G tokens, codes packed along T; ``axis="token"`` (values): groups of
    G channels, codes packed along D. Needs the grouped and packed lengths divisible (KIVI asserts that too).
    """
    levels = 2**bits - 1
    lanes = 32 // bits
    *lead, T, D = x.shape
    if axis == "channel":
        g = x.view(*lead, T // group_size, group_size, D)
        mn, mx = g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
    else:
        g = x.view(*lead, T, D // group_size, group_size)
        mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (mx - mn) / levels
    codes = ((g - mn) / scale).clamp_(0, levels).round_().to(torch.int32).view(*lead, T, D)
    dim = -2 if axis == "channel" else -1
    codes = codes.movedim(dim, -1)  # pack along the last dim
    packed = torch.zeros(*codes.shape[:-1], codes.shape[-1] // lanes, dtype=torch.int32, device=x.device)
    for lane in range(lanes):  # the anchor's loop over the 32/b lanes of an int32
        packed |= codes[..., lane::lanes] << (bits * lane)
    return packed.movedim(-1, dim), scale, mn


def anchor_unpack_dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    mn: torch.Tensor,
    bits: int,
    axis: str,
    group_size: int,
    shape: tuple[int, ...],
):
    """Shift every lane out of the int32 words, then ``code * scale + min`` in the input dtype (KIVI style)."""
    lanes = 32 // bits
    *lead, T, D = shape
    dim = -2 if axis == "channel" else -1
    p = packed.movedim(dim, -1)
    shifts = torch.arange(lanes, device=packed.device, dtype=torch.int32) * bits
    codes = ((p[..., None] >> shifts) & (2**bits - 1)).flatten(-2).movedim(-1, dim)
    if axis == "channel":
        data = codes.view(*lead, T // group_size, group_size, D).to(scale.dtype)
    else:
        data = codes.view(*lead, T, D // group_size, group_size).to(scale.dtype)
    return (data * scale + mn).view(*lead, T, D)


# ------------------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------------------
def _once(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_paired(fns: dict, device: torch.device, reps: int, warmup: int = 2) -> dict[str, list[float]]:
    """Wall times (ms, CUDA events on GPU) of each function, interleaved round by round.

    Interleaving puts a shared machine's bursts of load on every contender alike, so the per-round ratios
    stay meaningful when the absolute times do not.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_once(fn, device))
    return times


def summary(times: list[float], stat: str) -> float:
    return min(times) if stat == "min" else statistics.median(times)


def ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of ``num / den``."""
    return statistics.median(a / b for a, b in zip(num, den))


def nbytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()}-core {platform.machine()} CPU ({torch.get_num_threads()} torch threads), no GPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (T in {1024, 4096}) and fewer repetitions")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (median reported)")
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="statistic over the timed runs (min is steadier on a shared machine)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    B, H, D, G = 1, 8, 128, args.group_size
    lengths = (1024, 4096) if args.quick else (4096, 32768)
    reps = args.reps or (3 if args.quick else 10)
    on_gpu = device.type == "cuda"
    triton_path = kernels.use_triton(torch.empty(0, device=device))
    print(f"device: {device_name(device)}; torch {torch.__version__}; triton path: {triton_path}")
    print(f"shapes: B={B} H={H} D={D} G={G}, T in {lengths}; {args.stat} of {reps} runs, ms\n")
    cols = ["op", "axis", "bits", "dtype", "T"]
    cols += (
        ["dispatch", "reference", "anchor", "anchor/dispatch", "anchor/reference"]
        if on_gpu
        else ["reference", "anchor", "anchor/reference"]
    )
    cols += ["bytes ours", "bytes anchor", "err ours/anchor"]
    rows = []
    for T in lengths:
        for dtype in (torch.bfloat16, torch.float32):
            for bits in (2, 4):
                for axis in ("channel", "token"):
                    gen = torch.Generator(device=device).manual_seed(0)
                    x = torch.randn(B, H, T, D, device=device, generator=gen).to(dtype)
                    ours = kernels.quantize_pack_ref(x, bits, axis, G)
                    anchor = anchor_quantize_pack(x, bits, axis, G)
                    y_ours = kernels.unpack_dequantize_ref(*ours, bits, axis, G, tuple(x.shape), dtype)
                    y_anchor = anchor_unpack_dequantize(*anchor, bits, axis, G, tuple(x.shape))
                    err = float((y_ours.float() - x.float()).abs().mean() / (y_anchor.float() - x.float()).abs().mean())
                    common = [axis, bits, str(dtype).replace("torch.", ""), T]
                    tail = [nbytes(*ours), nbytes(*anchor), f"{err:.3f}"]
                    timings = {
                        "quantize+pack": (
                            lambda: kernels.quantize_pack(x, bits, axis, G),
                            lambda: kernels.quantize_pack_ref(x, bits, axis, G),
                            lambda: anchor_quantize_pack(x, bits, axis, G),
                        ),
                        "unpack+dequantize": (
                            lambda: kernels.unpack_dequantize(*ours, bits, axis, G, tuple(x.shape), dtype),
                            lambda: kernels.unpack_dequantize_ref(*ours, bits, axis, G, tuple(x.shape), dtype),
                            lambda: anchor_unpack_dequantize(*anchor, bits, axis, G, tuple(x.shape)),
                        ),
                    }
                    for op, (disp, ref, anc) in timings.items():
                        fns = {"dispatch": disp} if on_gpu else {}
                        fns.update(reference=ref, anchor=anc)
                        t = time_paired(fns, device, reps)
                        vals = [f"{summary(t[k], args.stat):.3f}" for k in fns]
                        if on_gpu:
                            vals.append(f"{ratio(t['anchor'], t['dispatch']):.2f}x")
                        vals.append(f"{ratio(t['anchor'], t['reference']):.2f}x")
                        rows.append([op, *common, *vals, *tail])
                        print(" | ".join(str(v) for v in rows[-1]), flush=True)
    print()
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(v) for v in r) + " |")


if __name__ == "__main__":
    main()
