"""SEKV decode step time with and without the fetch overlap of §3.3, through the HF adapter.

SEKV's decode step routes each query to its spans, attends over the accelerator-resident entries (Stage 1), and
attends over the spans it zooms into, rebuilt from low-rank factors held in host memory (Stage 2). The factors of the
selected spans have to reach the accelerator; §3.3 overlaps that copy with Stage 1. ``SEKVStore``'s ``fetch`` says
how: ``sync`` copies them before Stage 1 (no overlap), ``stream`` issues the copies on a CUDA copy stream and Stage 2
waits for them by an event (CUDA only; elsewhere it is ``sync``), ``thread`` issues them from a worker thread.

One run, one model, one prompt: a ``DynamicCache`` anchor and one SEKV cache per fetch mode, prefilled once each,
then ``--rounds`` interleaved rounds of ``--steps`` greedy decode steps (each rolled back); the median steps/s, its
ratio to ``DynamicCache`` and to ``sync``, and, from one more pass of the same steps, the spans expanded and the
bytes of factors moved per step (all layers).

Usage::

    python benchmarks/bench_sekv_decode.py                                  # SmolLM2, 2,000-token passkey prompt, CPU
    python benchmarks/bench_sekv_decode.py --random-model --device cuda --tokens 4000 --modes sync,stream,thread

``--random-model`` builds SmolLM2-135M's architecture with random weights and a random prompt (no weights or corpus
needed; the shipped router still routes, so spans are expanded, but which ones means nothing).
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch
from bench_hf_decode import dynamic_rate, random_smollm2

import kv_hf
import kv_sekv
from kvbench.run import decode_rate


@torch.no_grad()
def step_stats(model, cache, first: torch.Tensor, steps: int) -> tuple[float, float]:
    """Mean spans expanded and factor bytes moved per decode step, summed over the layers (the cache rolled back)."""
    stores = [layer.store for layer in cache.layers]
    length = cache.get_seq_length()
    tok, pos = first[:, None], cache.next_positions().to(first.device)[:, None]
    expanded = moved = 0
    try:
        for _ in range(steps):
            out = model(input_ids=tok, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
            tok, pos = out.logits[:, -1].argmax(-1, keepdim=True), pos + 1
            expanded += sum(s.last_step.expanded for s in stores)
            moved += sum(s.last_step.fetched_bytes for s in stores)
    finally:
        cache.rollback(length)
    return expanded / steps, moved / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--budget", type=float, default=0.1, help="accelerator share (default: %(default)s)")
    p.add_argument("--modes", default=None, help="fetch modes (default: sync,thread; sync,stream,thread on CUDA)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--random-model", action="store_true", help="SmolLM2's shapes with random weights and prompt")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    modes = (args.modes or ("sync,stream,thread" if device.type == "cuda" else "sync,thread")).split(",")
    bad = [m for m in modes if m not in kv_sekv.store.FETCH_MODES]
    if bad:
        raise SystemExit(f"--modes: unknown fetch mode(s) {bad}; allowed: {kv_sekv.store.FETCH_MODES}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.random_model:
        model = random_smollm2(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 10_000, (1, args.tokens), generator=g).to(device)
    else:
        from kvbench.models import load_smollm2
        from kvbench.tasks import passkey

        model, tok = load_smollm2(device=device)
        ids = torch.tensor([tok.encode(passkey(tok, args.tokens, seed=1).context)], device=device)
    caches = {}
    with torch.no_grad():
        for mode in modes:
            cache = kv_hf.compressed_cache(model, kv_sekv.sekv(args.budget, fetch=mode))
            first = kv_hf.prefill(model, cache, ids).argmax(-1)
            caches[mode] = (cache, first)
    rates: dict[str, list[float]] = {"DynamicCache": [], **{m: [] for m in modes}}
    for _ in range(args.rounds):  # interleaved: drifting load hits every contender alike
        rates["DynamicCache"] += dynamic_rate(model, ids, args.steps, 1)
        for mode, (cache, first) in caches.items():
            rates[mode].append(decode_rate(model, cache, first, args.steps))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU"
    print(
        f"# device: {where}, {torch.get_num_threads()} torch threads; torch {torch.__version__}; prompt "
        f"{ids.shape[1]} tokens; budget {args.budget}; {args.steps} steps x {args.rounds} rounds (median)"
        + ("; random weights" if args.random_model else "")
    )
    base = statistics.median(rates["DynamicCache"])
    sync = statistics.median(rates["sync"]) if "sync" in rates else None
    print("| cache | steps/s | vs DynamicCache | vs sync | spans expanded / step | factors moved / step (KB) |")
    print("|---|---|---|---|---|---|")
    print(f"| DynamicCache | {base:.2f} | 1.00x | | | |")
    for mode, (cache, first) in caches.items():
        med = statistics.median(rates[mode])
        expanded, moved = step_stats(model, cache, first, args.steps)
        vs_sync = f"{med / sync:.2f}x" if sync else ""
        print(
            f"| SEKV fetch={mode} | {med:.2f} | {med / base:.2f}x | {vs_sync} | {expanded:.1f} | {moved / 1024:.1f} |"
        )


if __name__ == "__main__":
    main()
