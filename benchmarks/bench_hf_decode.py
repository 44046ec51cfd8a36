"""Decode-step throughput of the HF adapter vs an unmodified transformers ``DynamicCache``.

One run, same model (``--model``: a kvbench registry name, default SmolLM2-135M-Instruct; ``gemma3-270m`` for Gemma 3
270M's hybrid sliding-window / global attention; offline), same random prompt, same greedy steps:

* ``DynamicCache``  the anchor: transformers' own cache, attention over the raw K/V (``torch.cat`` per step);
* ``kv_hf <method>`` our adapter over each method of ``--methods`` (registry names, ``name@budget`` for a budget
  other than the method's default; default ``full,snapkv@0.5,kivi-2``): the full cache in a kvcore ``DenseStore``,
  SnapKV after evicting half of every head, KIVI-2 decoding through its fused ``attend``. Stores that declare
  ``can_attend`` decode through ``Store.attend``.

Printed: KV bytes after the prefill (ours: ``cache.nbytes()``, int32 positions and sliding-window layers included;
DynamicCache: the storage its K+V tensors keep allocated after the prefill and one decode step — transformers'
sliding-window layer keeps its window as a slice of the prompt-long tensor until its next update),
single-token decode steps per second (median over ``--rounds`` interleaved rounds, each ``--steps`` steps after the
prefill, the cache rolled back between rounds) and each contender's ratio to ``DynamicCache``.

Usage::

    python benchmarks/bench_hf_decode.py                    # 1,000-token prompt, CPU or the first GPU
    python benchmarks/bench_hf_decode.py --tokens 4000 --device cuda
    python benchmarks/bench_hf_decode.py --tokens 2048 --steps 64 --methods kivi-2,kivi-4,hqekv-2,hqekv-3.2 --threads 1
    python benchmarks/bench_hf_decode.py --random-model --device cuda --tokens 8000   # a machine without the weights
    python benchmarks/bench_hf_decode.py --model gemma3-270m --tokens 2048 --methods full,snapkv@0.5,kivi-2

``--random-model`` builds SmolLM2-135M's architecture with random weights (same shapes, so the same decode work;
for timing only: its tokens mean nothing).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import DynamicCache

import kv_hf
from kvbench.budgets import parse_budget
from kvbench.models import get_model
from kvbench.run import decode_rate
from kvcore import registry, storage_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def held_bytes(cache: DynamicCache) -> int:
    """Bytes of the storage a ``DynamicCache``'s K/V tensors keep allocated (every layer kind: full, sliding)."""
    return storage_bytes([t for layer in cache.layers for t in (layer.keys, layer.values)])


@torch.no_grad()
def dynamic_rate(model, ids: torch.Tensor, steps: int, rounds: int) -> list[float]:
    """Steps/s over a fresh ``DynamicCache`` per round (prefill excluded from the timing)."""
    rates = []
    for _ in range(rounds):
        cache = DynamicCache(config=model.config)  # what generate() builds: sliding-window layers keep their window
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = torch.tensor([[ids.shape[1]]], device=ids.device)
        _sync(ids.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(tok, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
            tok, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
        _sync(ids.device)
        rates.append(steps / (time.perf_counter() - t0))
    return rates


def random_smollm2(device: torch.device, dtype: torch.dtype):
    """SmolLM2-135M's architecture (its published config) with seeded random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def contenders(methods_arg: str) -> dict:
    """``{"kv_hf <item>": compressor factory}`` for the registry names of a comma list (``name@budget`` for a budget
    other than the method's default); an unknown name raises here, before any model loads."""
    methods = registry.discover()
    out = {}
    for item in filter(None, (x.strip() for x in methods_arg.split(","))):
        name, _, budget = item.partition("@")
        registry.get(name, methods)
        spec = parse_budget(budget, "--methods budget").budget() if budget else None
        out[f"kv_hf {item}"] = lambda name=name, spec=spec: registry.build(name, spec, methods)
    return out


def model_and_prompt(args) -> tuple:
    """``(model, ids)``: SmolLM2-135M (or its shapes with random weights, ``args.random_model``) on ``args.device``
    with ``args.threads`` torch threads, and a seeded random prompt of ``args.tokens`` tokens."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.random_model:
        model = random_smollm2(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    else:
        model, _ = get_model(args.model).load(device=device)
    ids = torch.randint(100, 10_000, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(device)
    return model, ids


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--methods", default="full,snapkv@0.5,kivi-2", help="registry names, name@budget (default: %(default)s)"
    )
    p.add_argument("--random-model", action="store_true", help="SmolLM2's shapes with random weights (no download)")
    p.add_argument("--model", default="smollm2-135m", help="kvbench model registry name (default: %(default)s)")
    args = p.parse_args(argv)
    if args.random_model and args.model != "smollm2-135m":
        p.error("--random-model builds SmolLM2's shapes; it cannot be combined with --model")
    get_model(args.model)  # an unknown name fails before any model loads
    makers = contenders(args.methods)
    model, ids = model_and_prompt(args)
    device = ids.device
    caches = {}
    for name, make in makers.items():
        cache = kv_hf.compressed_cache(model, make())
        last = kv_hf.prefill(model, cache, ids)
        caches[name] = (cache, last.argmax(-1), cache.nbytes())  # bytes held after prefill, before any append
    rates: dict[str, list[float]] = {"DynamicCache": [], **{n: [] for n in makers}}
    for _ in range(args.rounds):  # interleaved, so drifting machine load hits every contender alike
        rates["DynamicCache"] += dynamic_rate(model, ids, args.steps, 1)
        for name, (cache, first, _) in caches.items():
            rates[name].append(decode_rate(model, cache, first, args.steps))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU"
    print(
        f"device: {where}, {torch.get_num_threads()} torch threads; torch {torch.__version__}; "
        f"model {args.model}; prompt {args.tokens} tokens; {args.steps} steps x {args.rounds} rounds (median)"
        + ("; random weights" if args.random_model else "")
    )
    base = statistics.median(rates["DynamicCache"])
    print("| cache | KV MB | steps/s | vs DynamicCache |")
    print("|---|---|---|---|")
    anchor = DynamicCache(config=model.config)
    with torch.no_grad():  # after the prefill and one decode step: a sliding layer frees the prompt at its next update
        model(ids, past_key_values=anchor, use_cache=True, logits_to_keep=1)
        model(ids[:, -1:], past_key_values=anchor, position_ids=torch.tensor([[ids.shape[1]]], device=device))
    full_mb = held_bytes(anchor) / 2**20
    for name, r in rates.items():
        mb = full_mb if name == "DynamicCache" else caches[name][2] / 2**20
        med = statistics.median(r)
        print(f"| {name} | {mb:.2f} | {med:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
