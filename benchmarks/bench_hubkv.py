"""HubKV score-stage microbenchmark (paper Appendix E, Table 5 shapes).

Synthetic bf16 score tensors ``[L, B, H_kv, N]`` with Qwen3-8B's ``L = 36``, ``H_kv = 8``; 4 sink
tokens and a ``floor(0.02 N)`` recent window protected; compression ratio 0.95. Times, in one run:

* ``select``        the base method's selection alone: protected -> +inf, top-k of the
                    ``(1 - r)·H·N`` best entries per (layer, batch row) over all its heads
                    (layer-wise, as KVzip), scattered into a keep mask (the plan);
* ``refine``        HubKV refinement alone (``kv_hubkv.refine``: Triton on CUDA, PyTorch on CPU);
* ``refine+select`` refinement followed by the same selection;
* with Triton also ``kernel`` (the two HubKV kernels' own device time per call, from ``torch.profiler``: what the
  call time adds on top of it is launch, argument checks and the host synchronisation), ``kernel (shifted)`` (the
  same with the mixing's earlier form, ``quad_path=False``: the tile reloaded per neighbour offset), the hot-path form
  ``kv_hubkv.Refiner(check="deferred")`` (reused scratch, no synchronisation per call: ``hot``), the same
  with the launch captured in a CUDA graph (``graph``), each followed by the selection, and the unfused PyTorch
  reference (``refine_torch``) on the GPU with Triton vs reference.

Ratios printed: ``overhead = (refine+select) / select - 1`` (Table 5's "Overhead") and
``ref/triton`` (speed-up of the fused kernel over the unfused reference).

Usage::

    python benchmarks/bench_hubkv.py            # CUDA: all Table 5 shapes; CPU: reference only
    python benchmarks/bench_hubkv.py --quick    # small shapes (CPU-friendly)
    TRITON_INTERPRET=1 python benchmarks/bench_hubkv.py --quick --force-triton   # script check, CPU

Medians from ``torch.utils.benchmark`` (which synchronises CUDA).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as tb

try:
    import kv_hubkv
except ImportError:  # running from a checkout without the workspace installed
    root = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(root / "packages/kv-hubkv/src"), str(root / "core/kvcore/src")]
    import kv_hubkv

from kv_hubkv import HubKVConfig, Refiner, refine_torch
from kv_hubkv.triton_kernel import HAS_TRITON, refine_triton, refine_triton_config

L_FULL, H_KV = 36, 8
N_FULL = (4096, 8192, 16384, 32768)
B_FULL = (1, 4)


def protected_mask(n: int, device) -> torch.Tensor:
    m = torch.zeros(1, 1, 1, n, dtype=torch.bool, device=device)
    m[..., :4] = True
    recent = math.floor(0.02 * n)
    if recent:
        m[..., n - recent :] = True
    return m


def select(scores: torch.Tensor, prot: torch.Tensor, ratio: float) -> torch.Tensor:
    """Keep mask of the base method's layer-wise top-k (protected always kept)."""
    s = scores.float().masked_fill(prot, float("inf"))
    flat = s.flatten(-2)  # [L, B, H*N]
    keep = max(1, math.floor(flat.shape[-1] * (1.0 - ratio)))
    idx = flat.topk(keep, dim=-1, sorted=False).indices
    mask = torch.zeros_like(flat, dtype=torch.bool)
    mask.scatter_(-1, idx, True)
    return mask.view_as(s)


def median_ms(fn, min_run_time: float) -> float:
    t = tb.Timer(stmt="fn()", globals={"fn": fn})
    return t.blocked_autorange(min_run_time=min_run_time).median * 1e3


def peak_mb(fn, device) -> float:
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def kernel_ms(fn, device, calls: int = 20) -> float:
    """Device time of the HubKV kernels (statistics + mixing launches) per call (``torch.profiler``), or NaN off
    CUDA."""
    if device.type != "cuda":
        return float("nan")
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = sum(e.self_device_time_total for e in prof.key_averages() if "_hubkv_" in e.key and "kernel" in e.key)
    return us / calls / 1e3


def _where(module) -> str:
    """The package folder, relative to this checkout when it lies inside it (no machine-local path printed)."""
    here = Path(module.__file__).resolve().parent
    try:
        return str(here.relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return "site-packages"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small shapes (L=4, N in {1024, 4096})")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--ratio", type=float, default=0.95)
    ap.add_argument("--min-run-time", type=float, default=None, help="seconds per measurement")
    ap.add_argument(
        "--force-triton",
        action="store_true",
        help="also time the Triton kernel off CUDA (needs TRITON_INTERPRET=1; checks this script only)",
    )
    args = ap.parse_args(argv)

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    use_triton = HAS_TRITON and (device.type == "cuda" or args.force_triton)
    L = 4 if args.quick else L_FULL
    ns = (1024, 4096) if args.quick else N_FULL
    min_run = args.min_run_time if args.min_run_time is not None else (0.2 if device.type == "cpu" else 0.5)
    ratio = args.ratio

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    print(
        f"# HubKV score-stage benchmark: device={name}, torch {torch.__version__}, "
        f"triton {'yes' if use_triton else 'not used'}, kv_hubkv from {_where(kv_hubkv)}"
    )
    print(
        f"# scores bf16 [L={L}, B, H={H_KV}, N], ratio={ratio}, protected = 4 sinks + floor(0.02 N) recent; "
        f"median ms (torch.utils.benchmark, min_run_time={min_run}s)"
    )
    cols = ["N", "B", "select", "refine", "refine+select", "overhead"]
    if use_triton:
        cols += ["kernel", "kernel (shifted)", "hot refine", "hot+select", "hot overhead"]
        if device.type == "cuda":
            cols += ["graph+select", "graph overhead"]
        cols += ["ref refine", "ref refine+select", "ref overhead", "ref/triton", "max abs diff", "peak MB"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))

    g = torch.Generator(device="cpu").manual_seed(0)
    for n in ns:
        for b in B_FULL:
            scores = torch.rand(L, b, H_KV, n, generator=g).to(device=device, dtype=torch.bfloat16)
            prot = protected_mask(n, device)
            fast = refine_triton if use_triton else refine_torch
            t_sel = median_ms(lambda: select(scores, prot, ratio), min_run)
            t_ref = median_ms(lambda: fast(scores, ratio, prot), min_run)
            t_both = median_ms(lambda: select(fast(scores, ratio, prot), prot, ratio), min_run)
            row = [n, b, f"{t_sel:.3f}", f"{t_ref:.3f}", f"{t_both:.3f}", f"{t_both / t_sel - 1:+.1%}"]
            if use_triton:
                hot = Refiner(check="deferred")
                t_k = kernel_ms(lambda: refine_triton(scores, ratio, prot), device)
                t_ks = kernel_ms(
                    lambda: refine_triton_config(scores, ratio, prot, HubKVConfig(), quad_path=False), device
                )
                t_hot = median_ms(lambda: hot(scores, ratio, prot), min_run)
                t_hot_both = median_ms(lambda: select(hot(scores, ratio, prot), prot, ratio), min_run)
                hot.raise_if_error()
                row += [f"{t_k:.3f}", f"{t_ks:.3f}", f"{t_hot:.3f}", f"{t_hot_both:.3f}"]
                row += [f"{t_hot_both / t_sel - 1:+.1%}"]
                if device.type == "cuda":
                    graph = Refiner(check="deferred", cuda_graph=True)
                    t_g = median_ms(lambda: select(graph(scores, ratio, prot), prot, ratio), min_run)
                    graph.raise_if_error()
                    row += [f"{t_g:.3f}", f"{t_g / t_sel - 1:+.1%}"]
                r_ref = median_ms(lambda: refine_torch(scores, ratio, prot), min_run)
                r_both = median_ms(lambda: select(refine_torch(scores, ratio, prot), prot, ratio), min_run)
                diff = (refine_triton(scores, ratio, prot) - refine_torch(scores, ratio, prot)).abs().max().item()
                mb = peak_mb(lambda: refine_triton(scores, ratio, prot), device)
                row += [
                    f"{r_ref:.3f}",
                    f"{r_both:.3f}",
                    f"{r_both / t_sel - 1:+.1%}",
                    f"{r_ref / t_ref:.2f}x",
                    f"{diff:.1e}",
                    f"{mb:.1f}",
                ]
            print("| " + " | ".join(map(str, row)) + " |", flush=True)


if __name__ == "__main__":
    main()
