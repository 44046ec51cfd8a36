"""KIVI decode on CPU: our KIVIStore (fused ``attend``) vs transformers' ``QuantizedCache`` (optimum-quanto) vs the
full cache, side by side in one run.

Same model (SmolLM2-135M-Instruct, offline), same random prompt, same greedy steps, interleaved rounds (drifting
machine load hits every contender alike); prefill excluded from the timings. Contenders:

* ``DynamicCache``  transformers' full-precision cache (the anchor, 1.00x);
* ``quanto-b``      transformers ``QuantizedCache(backend="quanto")`` at ``b`` bits, keys per channel
  (``axis_key=-1``), values per token (``axis_value=0``), group 32, residual 128 -- KIVI's settings;
* ``kv_hf kivi-b``  ``kv_baselines.kivi(b)`` through ``kv_hf`` (KIVIStore: keys per channel, values per token,
  G 32, R 128), decoding through ``KIVIStore.attend``.

Printed: KV bytes after the prefill (ours: ``cache.nbytes()``, positions and counts included; quanto: every tensor
its quantized layers hold -- packed codes, scales, shifts -- plus its full-precision residual; DynamicCache: K+V), the
percentage of the full cache, decode steps per second (median over ``--rounds``) and the ratio to ``DynamicCache``.

KIVI keeps a full-precision residual of up to R = 128 tokens per head from the prefill on (the last
``T mod R`` keys and the last ``min(T, R)`` values); HF's ``QuantizedCache`` quantizes the whole prompt at prefill
and only starts a residual afterwards, so at the same bits it holds fewer bytes right after the prefill.

Usage::

    python benchmarks/bench_kivi_decode.py                     # 2,048-token prompt, 1 torch thread
    python benchmarks/bench_kivi_decode.py --tokens 4096 --threads 2
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from transformers import DynamicCache, QuantizedCache

import kv_baselines
import kv_hf
from kvbench.models import load_smollm2
from kvbench.run import decode_rate


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor, walking quanto's tensor subclasses down to the plain tensors they hold."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is None or type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
        return t.numel() * t.element_size()
    names, _ = flatten()
    return sum(_tensor_bytes(getattr(t, n)) for n in names)


def quanto_bytes(cache: QuantizedCache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values", "keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += _tensor_bytes(t)
    return total


@torch.no_grad()
def hf_rate(model, ids: torch.Tensor, steps: int, make) -> tuple[float, int]:
    """Steps/s over a fresh HF cache (prefill excluded) and its bytes right after the prefill."""
    cache = make()
    out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nbytes = quanto_bytes(cache) if isinstance(cache, QuantizedCache) else None
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    pos = torch.tensor([[ids.shape[1]]])
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(tok, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
        tok, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
    return steps / (time.perf_counter() - t0), nbytes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_smollm2(device="cpu")
    cfg = model.config
    ids = torch.randint(100, 10_000, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    hf = {"DynamicCache": DynamicCache}
    for b in args.bits:
        hf[f"quanto-{b}"] = lambda b=b: QuantizedCache(
            backend="quanto", config=cfg, nbits=b, axis_key=-1, axis_value=0, q_group_size=32, residual_length=128
        )
    ours = {}
    for b in args.bits:
        cache = kv_hf.compressed_cache(model, kv_baselines.kivi(b))
        last = kv_hf.prefill(model, cache, ids)
        ours[f"kv_hf kivi-{b}"] = (cache, last.argmax(-1), cache.nbytes())
    rates: dict[str, list[float]] = {n: [] for n in [*hf, *ours]}
    sizes: dict[str, int] = {n: v[2] for n, v in ours.items()}
    for make in hf.values():  # warm-up (quanto builds its extension on first use), not timed
        hf_rate(model, ids[:, :64], 2, make)
    for cache, first, _ in ours.values():
        decode_rate(model, cache, first, 2)
    for _ in range(args.rounds):
        for name, make in hf.items():
            r, nbytes = hf_rate(model, ids, args.steps, make)
            rates[name].append(r)
            if nbytes is not None:
                sizes[name] = nbytes
        for name, (cache, first, _) in ours.items():
            rates[name].append(decode_rate(model, cache, first, args.steps))
    D = cfg.hidden_size // cfg.num_attention_heads
    full = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * D * args.tokens * next(model.parameters()).element_size()
    )
    sizes["DynamicCache"] = full
    load = os.getloadavg()
    print(
        f"machine: {platform.machine()} CPU, {os.cpu_count()} cores, load average {load[0]:.2f}/{load[1]:.2f}/"
        f"{load[2]:.2f}; {args.threads} torch thread(s); torch {torch.__version__}; prompt {args.tokens} tokens; "
        f"{args.steps} steps x {args.rounds} rounds (median)"
    )
    base = statistics.median(rates["DynamicCache"])
    print("| cache | KV MB after prefill | % of full | steps/s | vs DynamicCache |")
    print("|---|---|---|---|---|")
    for name, r in rates.items():
        med = statistics.median(r)
        mb = sizes[name] / 2**20
        print(f"| {name} | {mb:.2f} | {100 * sizes[name] / full:.1f}% | {med:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
