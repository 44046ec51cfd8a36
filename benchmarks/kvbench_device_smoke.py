"""Every registered method through kvbench's evaluation loop on one device, on SmolLM2-135M's shapes (random weights).

A machine without the SmolLM2 weights (a lent GPU cannot download them, and they are larger than what travels to
it) can still run kvbench's whole path — shared prefills, each method's compression and store, greedy answers,
continuation windows, decode rate, paired statistics — in the dtype ``kvbench`` picks for the device (bfloat16 on
CUDA). Scores of a random model mean nothing; what this checks is that every method runs there, holds the bytes it
should, and how fast its prefill and decode are on that device::

    python benchmarks/kvbench_device_smoke.py --device cuda --tokens 2000
    python benchmarks/kvbench_device_smoke.py --device cpu --tokens 300 --methods snapkv,kivi-2   # a quick look

Prints the machine description and kvbench's table; exits 1 when a method failed (its row's error is printed).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from bench_hf_decode import random_smollm2

from kvbench.budgets import parse_budgets
from kvbench.cli import _count  # whole-number arguments with a one-line error
from kvbench.methods import parse_methods, plan_grid
from kvbench.paired import pair_rows
from kvbench.report import format_table
from kvbench.run import Workload, describe_machine, run_grid
from kvbench.tasks import TaskSample
from kvcore.registry import discover


class ByteTokenizer:
    """Characters as token ids below 256 (inside SmolLM2's vocabulary; no tokenizer files needed)."""

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [min(ord(c), 255) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def workload(tokens: int, samples: int, windows: int, seed: int = 0) -> Workload:
    """``samples`` needle prompts of ~``tokens`` characters and ``windows`` random continuation windows."""
    g = torch.Generator().manual_seed(seed)
    words = ["river", "stone", "cloud", "amber", "delta", "north", "piano", "quartz"]
    out = []
    for _ in range(samples):
        filler = " ".join(words[int(j)] for j in torch.randint(0, len(words), (tokens // 6,), generator=g))
        key = str(int(torch.randint(100, 999, (1,), generator=g)))
        cut = len(filler) // 2
        text = f"{filler[:cut]} The key is {key}. {filler[cut:]}"[:tokens]
        out.append(TaskSample(text, " The key is", [key], max_new_tokens=4, task="needle", target_length=tokens))
    pairs = [
        (torch.randint(3, 256, (tokens,), generator=g).tolist(), torch.randint(3, 256, (32,), generator=g).tolist())
        for _ in range(windows)
    ]
    return Workload(out, pairs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--methods", default=None, help="comma list of registered names (default: every registered one)")
    p.add_argument("--budgets", default="0.75", help="budgets for methods that take them (default: %(default)s)")
    p.add_argument("--tokens", type=_count(16), default=2000, help="prompt and window length (default: %(default)s)")
    p.add_argument("--samples", type=_count(0), default=2, help="needle prompts (default: %(default)s)")
    p.add_argument("--windows", type=_count(0), default=2, help="continuation windows (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (on stderr)")
    args = p.parse_args(argv)

    registry = discover()
    names = args.methods or ",".join(sorted(n for n in registry if n != "full"))
    grid = plan_grid(registry, parse_methods(names), parse_budgets(args.budgets))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    machine = describe_machine(args.device)
    print(f"machine: {machine['device_name']}; torch {machine['torch']}; {dtype}; {len(grid)} grid items", flush=True)
    model = random_smollm2(device, dtype)
    t0 = time.perf_counter()
    rows = run_grid(
        model,
        ByteTokenizer(),
        registry,
        grid,
        workload(args.tokens, args.samples, args.windows),
        progress=not args.no_progress,
    )
    rows = pair_rows(rows, "full")
    print(format_table(rows))
    failed = [r for r in rows if r.error]
    for r in failed:
        print(f"FAILED {r.method} {r.budget}: {r.error}")
    print(f"wall {time.perf_counter() - t0:.0f} s; {len(rows) - len(failed)} rows ran, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
