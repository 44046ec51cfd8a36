"""Prefill + compression time through the HF adapter, per method, vs an unmodified transformers prefill.

One run, same model (SmolLM2-135M-Instruct, offline, or its shapes with random weights), same random prompt:

* ``DynamicCache``  the anchor: the model's own prefill into transformers' cache;
* ``kv_hf <method>`` ``kv_hf.prefill`` into a compressed cache for each method of ``--methods`` (registry names,
  ``name@budget`` for another budget): the same forward pass plus what the method does at prefill (queries
  captured where its scorer needs them, scoring, selection, quantization, the Store's ``write``).

Printed: seconds per prefill (median over ``--rounds`` interleaved rounds, so drifting load hits every contender
alike), the overhead over ``DynamicCache`` in seconds and as a ratio, and the KV bytes held afterwards.

Usage::

    python benchmarks/bench_hf_prefill.py --tokens 2048 --threads 1
    python benchmarks/bench_hf_prefill.py --methods hex-3,hqekv-2,sekv --rounds 5
    python benchmarks/bench_hf_prefill.py --random-model --device cuda --tokens 8000
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from bench_hf_decode import contenders, model_and_prompt
from transformers import DynamicCache

import kv_hf


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="prompt length (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds, median (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--methods",
        default="full,snapkv,kivi-2,hqekv-2,hex-3,sekv",
        help="registry names, name@budget (default: %(default)s)",
    )
    p.add_argument("--random-model", action="store_true", help="SmolLM2's shapes with random weights (no download)")
    args = p.parse_args(argv)
    makers = contenders(args.methods)
    model, ids = model_and_prompt(args)
    device = ids.device
    times: dict[str, list[float]] = {"DynamicCache": [], **{n: [] for n in makers}}
    held: dict[str, int] = {}
    with torch.no_grad():
        for _ in range(args.rounds):
            _sync(device)
            t0 = time.perf_counter()
            model(ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
            _sync(device)
            times["DynamicCache"].append(time.perf_counter() - t0)
            for name, make in makers.items():
                cache = kv_hf.compressed_cache(model, make())
                _sync(device)
                t0 = time.perf_counter()
                kv_hf.prefill(model, cache, ids)
                _sync(device)
                times[name].append(time.perf_counter() - t0)
                held[name] = cache.nbytes()
                del cache
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU"
    weights = "; random weights" if args.random_model else ""
    print(
        f"device: {where}, {torch.get_num_threads()} torch threads; torch {torch.__version__}; "
        f"prompt {args.tokens} tokens; {args.rounds} rounds (median){weights}"
    )
    base = statistics.median(times["DynamicCache"])
    print("| cache | prefill s | overhead s | vs DynamicCache | KV MB held |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        mb = f"{held[name] / 2**20:.2f}" if name in held else "–"
        print(f"| {name} | {med:.2f} | {med - base:+.2f} | {med / base:.2f}x | {mb} |")


if __name__ == "__main__":
    main()
