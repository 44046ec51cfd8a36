"""Results of a kvbench run: one row per (method, ratio); JSON, terminal table and a PNG plot."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Row:
    """Aggregated measurements of one method at one ratio."""

    method: str
    ratio: float
    accuracy: dict[str, float] = field(default_factory=dict)  # task -> mean score in [0, 1]
    kl: float | None = None  # mean teacher-forced next-token KL(full || compressed), nats
    ppl: float | None = None  # perplexity of the continuation given the compressed context
    kv_bytes: float = 0.0  # mean KV bytes held after compression (all layers)
    kv_fraction: float = 0.0  # kv_bytes / bytes of the uncompressed cache in the model dtype
    prefill_s: float = 0.0  # mean prefill time including compression
    compress_s: float = 0.0  # mean time of the compression itself within prefill (CompressedCache.compress_seconds)
    peak_bytes: int | None = None  # peak extra memory during prefill + compression
    # single-token decode steps per second over the compressed cache (kvbench.run.decode_rate)
    decode_tok_s: float | None = None
    samples: int = 0
    error: str | None = None  # why this configuration could not run (e.g. budget below the protected count)

    @property
    def mean_accuracy(self) -> float | None:
        return sum(self.accuracy.values()) / len(self.accuracy) if self.accuracy else None


def write_json(rows: list[Row], path: Path, meta: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": [asdict(r) | {"mean_accuracy": r.mean_accuracy} for r in rows]}
    path.write_text(json.dumps(payload, indent=2))


def format_table(rows: list[Row]) -> str:
    """A Markdown table (also readable on a terminal)."""
    tasks = sorted({t for r in rows for t in r.accuracy})
    head = [
        "method",
        "ratio",
        *tasks,
        "mean acc",
        "KL",
        "ppl",
        "KV MB",
        "% full",
        "prefill s",
        "compress s",
        "peak MB",
        "decode tok/s",
    ]

    def f(x, spec=".3f"):
        return "–" if x is None else format(x, spec)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"| {r.method} | {r.ratio:g} | not run: {r.error} |" + " |" * (len(head) - 3))
            continue
        cells = [
            r.method,
            f"{r.ratio:g}",
            *(f(r.accuracy.get(t), ".2f") for t in tasks),
            f(r.mean_accuracy, ".2f"),
            f(r.kl, ".4f"),
            f(r.ppl, ".2f"),
            f(r.kv_bytes / 2**20, ".2f"),
            f(100 * r.kv_fraction, ".1f"),
            f(r.prefill_s, ".2f"),
            f(r.compress_s, ".2f"),
            f(None if r.peak_bytes is None else r.peak_bytes / 2**20, ".0f"),
            f(r.decode_tok_s, ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, title: str = "") -> None:
    """Quality vs KV bytes: mean task accuracy and KL against % of the fp16 cache, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in dict.fromkeys(r.method for r in rows):
        pts = sorted((r for r in rows if r.method == method and not r.error), key=lambda r: r.kv_fraction)
        x = [100 * r.kv_fraction for r in pts]
        axes[0].plot(x, [r.mean_accuracy for r in pts], "o-", label=method)
        axes[1].plot(x, [r.kl for r in pts], "o-", label=method)
    axes[0].set(xlabel="KV bytes (% of the full cache)", ylabel="mean task accuracy", ylim=(-0.05, 1.05))
    axes[1].set(xlabel="KV bytes (% of the full cache)", ylabel="next-token KL(full || compressed), nats")
    axes[1].set_yscale("symlog", linthresh=1e-3)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
