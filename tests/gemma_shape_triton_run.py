"""Run by tests/test_gemma_shape_triton.py in a fresh interpreter (``TRITON_INTERPRET=1`` must be set before triton
is imported): every method with Triton kernels, on a tiny hybrid model with Gemma 3 270M's attention shape (one KV
head of 256 channels under 4 query heads, sliding-window layers beside global ones), through kv-hf's prefill and
greedy decode, once on the PyTorch references and once with every dispatch point of
``benchmarks/decode_census.py``'s ``DISPATCH`` forced onto the Triton kernels (the interpreter). Prints one JSON
object: ``{method: {"max_abs": ..., "max_ref": ..., "tokens_equal": ...}}`` over the logits of every step.

Usage: ``TRITON_INTERPRET=1 python tests/gemma_shape_triton_run.py METHOD [METHOD ...]``
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") != "1":
    raise SystemExit("set TRITON_INTERPRET=1 before running this script (Triton reads it at import)")

import torch

import kv_hf
from kv_hf.testing import tiny_model
from kvcore import Budget
from kvcore.registry import discover

ROOT = Path(__file__).resolve().parents[1]
T, W, STEPS = 200, 8, 3


def census():
    spec = importlib.util.spec_from_file_location("decode_census", ROOT / "benchmarks" / "decode_census.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compressor(name: str, model):
    if name == "sekv":  # a router for this tiny model's layers and heads, untrained
        from kv_sekv import SEKVConfig, SEKVRouter, sekv

        c = model.config
        config = SEKVConfig(window=4, min_span=3, max_rank=8, proj_dim=8)
        router = SEKVRouter.untrained(4, c.num_attention_heads, c.num_key_value_heads, c.head_dim, config, seed=0)
        return sekv(0.5, router=router, config=config)
    method = discover()[name]
    return method.build(Budget(ratio=0.5) if "ratio" in method.budgets else None)


@torch.no_grad()
def run(name: str) -> torch.Tensor:
    torch.manual_seed(0)
    model = tiny_model("gemma3", num_hidden_layers=4, sliding_window=W, num_key_value_heads=1, head_dim=256,
                       num_attention_heads=4)  # fmt: skip
    ids = torch.randint(3, 250, (1, T), generator=torch.Generator().manual_seed(1))
    cache = kv_hf.compressed_cache(model, compressor(name, model))
    logits = [kv_hf.prefill(model, cache, ids)]
    for step in range(STEPS):
        token = logits[-1].argmax(-1, keepdim=True)
        logits.append(model(token, past_key_values=cache, position_ids=torch.tensor([[T + step]])).logits[:, -1])
    return torch.stack(logits)


def main(names: list[str]) -> None:
    reference = {name: run(name) for name in names}
    patched = census().force_triton()
    out = {"patched": patched}
    for name in names:
        triton = run(name)
        ref = reference[name]
        out[name] = {
            "max_abs": float((triton - ref).abs().max()),
            "max_ref": float(ref.abs().max()),
            "tokens_equal": bool(torch.equal(triton.argmax(-1), ref.argmax(-1))),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
