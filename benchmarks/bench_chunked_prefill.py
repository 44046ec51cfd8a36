"""Peak KV memory of the prefill vs context length: chunked prefill with compression after every chunk against
one-shot compression (whole prompt collected raw, then compressed).

One run, same model (SmolLM2-135M-Instruct, offline, float32), same random prompt per length. For every
(method, length, mode) a fresh subprocess loads the model and prefills once:

* ``one-shot``  ``kv_hf.prefill(model, cache, ids)``: every layer holds the whole raw prompt until it is compressed;
* ``chunked``   ``kv_hf.prefill(model, cache, ids, chunk_size=C, compress_chunks=True)``: after every chunk the
  held entries are cut to the count the budget implies for the whole prompt, so at most budget + one chunk.

Printed per row: the peak KV bytes held (``cache.nbytes()``, Stores plus raw pending entries, read after every
decoder layer's forward pass during the prefill), the KV bytes held at the end, the process's peak RSS
(``ru_maxrss``: model, activations and allocator included), peak ``torch.cuda.max_memory_allocated`` on CUDA, and
the prefill wall time.

Usage::

    python benchmarks/bench_chunked_prefill.py                          # 2k, 4k, 8k; snapkv and knorm at ratio 0.9
    python benchmarks/bench_chunked_prefill.py --lengths 2048,4096 --chunk 512 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch

METHODS = ("snapkv", "knorm")


def _compressor(method: str, ratio: float):
    import kv_baselines

    if method == "snapkv":
        return kv_baselines.snapkv(ratio)
    if method == "knorm":
        return kv_baselines.knorm(ratio)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


@torch.no_grad()
def worker(method: str, ratio: float, length: int, chunk: int | None, device: str, threads: int | None) -> dict:
    """One prefill in this process; returns its measurements."""
    import kv_hf
    from kvbench.models import load_smollm2

    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    model, _ = load_smollm2(device=dev)
    ids = torch.randint(100, 10_000, (1, length), generator=torch.Generator().manual_seed(0)).to(dev)
    cache = kv_hf.compressed_cache(model, _compressor(method, ratio))
    peak = [0]

    def watch(module, args, output):
        peak[0] = max(peak[0], cache.nbytes())

    hooks = [layer.register_forward_hook(watch) for layer in model.model.layers]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    if chunk is None:
        kv_hf.prefill(model, cache, ids)
    else:
        kv_hf.prefill(model, cache, ids, chunk_size=chunk, compress_chunks=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    for h in hooks:
        h.remove()
    peak[0] = max(peak[0], cache.nbytes())
    return {
        "peak_kv": peak[0],
        "final_kv": cache.nbytes(),
        "held_per_head": int(cache.seq_lengths()[0].max()),
        "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "cuda_peak": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        "seconds": seconds,
    }


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:8.1f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192", help="comma-separated prompt lengths")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--ratio", type=float, default=0.9, help="fraction removed")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        method, length, chunk = args.worker.split(":")
        out = worker(method, args.ratio, int(length), int(chunk) or None, args.device, args.threads)
        print(json.dumps(out))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    methods = args.methods.split(",")
    print(f"# {platform.platform()} | {platform.processor() or platform.machine()} | torch {torch.__version__}")
    print(f"# device={args.device} threads={args.threads or torch.get_num_threads()} loadavg={os.getloadavg()}")
    print(f"# ratio={args.ratio} chunk={args.chunk}; MiB; rss = whole-process peak (model + activations)")
    print(
        f"{'method':8} {'T':>6} {'mode':9} {'peak KV':>9} {'final KV':>9} {'kept/head':>9} {'peak RSS':>9} "
        f"{'cuda peak':>9} {'seconds':>8}"
    )
    for method in methods:
        for length in lengths:
            for mode, chunk in (("one-shot", 0), ("chunked", args.chunk)):
                cmd = [
                    sys.executable,
                    __file__,
                    "--worker",
                    f"{method}:{length}:{chunk}",
                    "--ratio",
                    str(args.ratio),
                    "--device",
                    args.device,
                ]
                if args.threads:
                    cmd += ["--threads", str(args.threads)]
                res = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if res.returncode:
                    print(f"{method:8} {length:>6} {mode:9} failed: {res.stderr.strip().splitlines()[-1:]}")
                    continue
                r = json.loads(res.stdout.strip().splitlines()[-1])
                print(
                    f"{method:8} {length:>6} {mode:9} {_mib(r['peak_kv'])} {_mib(r['final_kv'])} "
                    f"{r['held_per_head']:>9} {_mib(r['rss'])} {_mib(r['cuda_peak'])} {r['seconds']:8.1f}",
                    flush=True,
                )
    print(f"# loadavg at end={os.getloadavg()}")


if __name__ == "__main__":
    main()
