"""How much SEKV zooms in on SmolLM2-135M-Instruct: spans the gate selects, spans the budget cap lets through,
tokens reconstructed and bytes of span factors moved from host memory per decode step (Eq. 20), summed over the 30
layers, with the bytes held on the accelerator tier and in host memory after the prefill, for SEKV and its Table 5
ablations.

A passkey prompt of ``--tokens`` tokens from the local corpus is prefilled with each compressor at ``--budget`` (the
accelerator share; 0.1 is the paper's 10 %), then ``--steps`` tokens are decoded greedily; the table gives the mean
per decode step. Run: ``uv run python benchmarks/sekv_zoom_rate.py [--tokens 1000 --budget 0.1 --steps 16]``.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

import kv_hf
import kv_sekv
from kvbench.models import load_smollm2
from kvbench.tasks import passkey

VARIANTS = {
    "sekv": kv_sekv.sekv,
    "sekv-short-spans": lambda budget: kv_sekv.sekv(budget, config=kv_sekv.SEKVConfig(max_span="auto")),
    "sekv-untrained": kv_sekv.sekv_untrained,
    "sekv-global-tau": kv_sekv.sekv_global_threshold,
    "sekv-mean-pool": kv_sekv.sekv_mean_pooling,
    "sekv-fixed-spans": kv_sekv.sekv_fixed_spans,
    "sekv-no-svd": kv_sekv.sekv_no_svd,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1000, help="prompt length (default: %(default)s)")
    parser.add_argument("--budget", type=float, default=0.1, help="accelerator share (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps (default: %(default)s)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated (default: all)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = load_smollm2()
    ids = torch.tensor([tok.encode(passkey(tok, args.tokens, seed=1).context)])
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {ids.shape[1]} prompt tokens")
    print(
        "| variant | spans (30 layers) | selected / step | expanded / step | tokens rebuilt / step "
        "| factors moved / step (KB) | resident (MB) | host bases (MB) | s / step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.variants.split(","):
        build = VARIANTS[name]
        cache = kv_hf.compressed_cache(model, build(budget=args.budget))
        with torch.no_grad():
            logits = kv_hf.prefill(model, cache, ids)
            stores = [layer.store for layer in cache.layers]
            spans = sum(int(s._spans.alive.sum()) for s in stores)
            tiers = [s.bytes_by_tier() for s in stores]
            resident, bases = (sum(t[k] for t in tiers) / 2**20 for k in ("resident", "bases"))
            nxt = logits.argmax(-1, keepdim=True)
            sel = exp = toks = moved = 0
            t = time.perf_counter()
            for _ in range(args.steps):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                sel += sum(s.last_step.selected for s in stores)
                exp += sum(s.last_step.expanded for s in stores)
                toks += sum(s.last_step.tokens for s in stores)
                moved += sum(s.last_step.fetched_bytes for s in stores)
            secs = (time.perf_counter() - t) / args.steps
        n = args.steps
        print(
            f"| {name} | {spans} | {sel / n:.1f} | {exp / n:.1f} | {toks / n:.1f} | {moved / n / 1024:.1f} "
            f"| {resident:.2f} | {bases:.2f} | {secs:.2f} |"
        )


if __name__ == "__main__":
    main()
