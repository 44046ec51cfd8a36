"""Every registered page codec (kvpages' built-ins and those kv-hex and kv-hqekv register under
``kvcompress.codecs``): stored bytes per token and round-trip error, the figures kv-vllm's connector and kv-sglang's
HiCache backend get, since both store pages through these codecs by name.

    OMP_NUM_THREADS=1 uv run python benchmarks/bench_method_codecs.py [--page-size 64] [--tokens 512] [--no-model]

Bytes are exact (the stored blob, frame included) for one page of ``--page-size`` tokens of one layer, at
SmolLM2-135M's layer shape (3 KV heads x 64 dims) and Llama-3-8B's (8 x 128). Errors are relative Frobenius errors
``‖x̂ - x‖ / ‖x‖`` of keys and of values, pooled over pages: on random normal fp16 pages (16 pages per shape) and,
unless ``--no-model``, on SmolLM2-135M-Instruct's real KV cache (post-RoPE keys) of a ``--tokens``-token prompt,
every layer cut into pages. With the model, a second table gives how often a query-free score picks the token of
highest accumulated attention of each page (the heavy-hitter proxy of the HEX and HqeKV codecs).
"""

from __future__ import annotations

import argparse
import platform

import torch

import kvpages

SHAPES = {"SmolLM2-135M (3x64)": (3, 64), "Llama-3-8B (8x128)": (8, 128)}


def rel_errors(codec: kvpages.PageCodec, pages: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """Pooled relative errors of keys and values over ``pages``."""
    num = [0.0, 0.0]
    den = [0.0, 0.0]
    for k, v in pages:
        k2, v2 = codec.decode(codec.encode(k, v))
        for i, (x, y) in enumerate(((k, k2), (v, v2))):
            num[i] += float((y.float() - x.float()).pow(2).sum())
            den[i] += float(x.float().pow(2).sum())
    return (num[0] / den[0]) ** 0.5, (num[1] / den[1]) ** 0.5


def random_pages(P: int, H: int, D: int, n: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(P, H, D, generator=g).half(), torch.randn(P, H, D, generator=g).half()) for _ in range(n)]


def smollm2_kv(tokens: int):
    """Per layer ``(keys [T, H, D], values [T, H, D], accumulated attention [T])`` of a passkey prompt."""
    from kvbench.models import load_smollm2
    from kvbench.tasks import passkey

    model, tok = load_smollm2(attn_implementation="eager")
    sample = passkey(tok, tokens + 64, depth=0.5, seed=1)
    ids = torch.tensor([tok.encode(sample.context + sample.question)])[:, :tokens]
    with torch.no_grad():
        out = model(ids, output_attentions=True, use_cache=True)
    T = ids.shape[1]
    layers = []
    for i, att in enumerate(out.attentions):
        layer = out.past_key_values.layers[i]
        k, v = layer.keys[0].transpose(0, 1).half(), layer.values[0].transpose(0, 1).half()
        acc = att[0].float().sum((0, 1)) / torch.arange(T, 0, -1)  # per key: mean over the queries that see it
        layers.append((k.contiguous(), v.contiguous(), acc))
    return layers


def proxies(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    kf, vf = k.float(), v.float()
    dev = (kf - kf.mean(0, keepdim=True)).norm(dim=-1)
    return {
        "key norm": kf.norm(dim=-1).sum(-1),
        "value norm": vf.norm(dim=-1).sum(-1),
        "1 / value norm": (1 / vf.norm(dim=-1).clamp_min(1e-12)).sum(-1),
        "key deviation": dev.sum(-1),
        "sink score (deviation / value norm)": (dev / vf.norm(dim=-1).clamp_min(1e-12)).sum(-1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--no-model", action="store_true")
    a = ap.parse_args()
    P = a.page_size
    names = kvpages.codec_names()
    print(f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads; page {P} tokens")
    real = None
    if not a.no_model:
        layers = smollm2_kv(a.tokens)
        real = [(k[i : i + P], v[i : i + P]) for k, v, _ in layers for i in range(0, k.shape[0] - P + 1, P)]
        print(f"SmolLM2-135M-Instruct KV: {len(layers)} layers x {len(real) // len(layers)} pages of {P} tokens")
    rand = {label: random_pages(P, H, D) for label, (H, D) in SHAPES.items()}
    head = "| codec | " + " | ".join(f"bytes/token {s} | vs fp16" for s in SHAPES)
    head += " | rel. error K / V, random 3x64 | rel. error K / V, random 8x128 |"
    if real is not None:
        head += " rel. error K / V, SmolLM2 KV |"
    print()
    print(head)
    print("|---|" + "---:|" * (2 * len(SHAPES) + 2 + (real is not None)))
    for name in names:
        codec = kvpages.codec(name)
        row = [f"`{name}`"]
        for H, D in SHAPES.values():
            k, v = rand[next(lb for lb, s in SHAPES.items() if s == (H, D))][0]
            nbytes = len(codec.encode(k, v))
            row += [f"{nbytes / P:,.1f}", f"{codec.fp16_bytes(P, H, D) / nbytes:.2f}x"]
        for label in SHAPES:
            ek, ev = rel_errors(codec, rand[label])
            row.append(f"{ek:.4f} / {ev:.4f}")
        if real is not None:
            ek, ev = rel_errors(codec, real)
            row.append(f"{ek:.4f} / {ev:.4f}")
        print("| " + " | ".join(row) + " |")
    if not a.no_model:
        print()
        print(f"| query-free score | picks the page's top accumulated-attention token ({P}-token pages, all layers) |")
        print("|---|---:|")
        hits: dict[str, int] = {}
        n = 0
        for k, v, acc in layers:
            for i in range(0, k.shape[0] - P + 1, P):
                top = int(acc[i : i + P].argmax())
                for label, s in proxies(k[i : i + P], v[i : i + P]).items():
                    hits[label] = hits.get(label, 0) + int(int(s.argmax()) == top)
                n += 1
        print(f"| (chance) | {1 / P:.3f} |")
        for label, h in hits.items():
            print(f"| {label} | {h / n:.3f} |")


if __name__ == "__main__":
    main()
