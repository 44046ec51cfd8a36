"""Results of a kvbench run: one row per (method, budget, protocol); JSON, Markdown table and report, plots."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvbench.stats import PairedDiff


@dataclass
class Row:
    """Aggregated measurements of one method at one budget under one protocol, with its per-unit results."""

    method: str
    budget: str = "r0"  # budget label: r0.5 (ratio removed), 256t (tokens), 2.5bits (average bits)
    protocol: str = "agnostic"  # "agnostic": context compressed before the question; "aware": with the question
    accuracy: dict[str, float] = field(default_factory=dict)  # task@length -> mean score in [0, 1]
    scores: list[float] = field(default_factory=list)  # per task sample, in workload order (the pairing unit)
    window_kl: list[float] | None = None  # per continuation window: KL(full || compressed), nats
    kl: float | None = None  # mean of window_kl
    ppl: float | None = None  # perplexity of the continuations given the compressed context
    kv_bytes: float = 0.0  # mean KV bytes held after compression (all layers), CompressedCache.nbytes()
    bytes_per_token: float = 0.0  # mean held bytes per compressed context token
    # mean bytes per context token in the fast tier (Store.resident_nbytes: less what a store offloads on purpose,
    # such as SEKV's span bases in host memory); the x-axis of the plots and what --match-bytes matches
    resident_bytes_per_token: float | None = None
    fp16_fraction: float = 0.0  # held bytes / bytes of the same tokens in an uncompressed fp16 cache
    prefill_s: float = 0.0  # mean prefill time including compression
    compress_s: float = 0.0  # mean time of the compression itself within prefill (CompressedCache.compress_seconds)
    peak_bytes: int | None = None  # peak extra memory during prefill + compression
    # single-token decode steps per second over the compressed cache (kvbench.run.decode_rate)
    decode_tok_s: float | None = None
    samples: int = 0  # task samples + continuation windows
    error: str | None = None  # why this configuration could not run (e.g. budget below the protected count)
    matched: dict[str, float] | None = None  # bytes-per-token target and what the chosen budget holds
    reference: str | None = None  # "method budget" of the row this one is paired with
    acc_ci: PairedDiff | None = None  # mean accuracy over samples with its bootstrap CI
    kl_ci: PairedDiff | None = None  # mean KL over windows with its bootstrap CI
    d_acc: PairedDiff | None = None  # paired accuracy difference vs the reference (per sample)
    d_kl: PairedDiff | None = None  # paired KL difference vs the reference (per window)

    @property
    def mean_accuracy(self) -> float | None:
        return sum(self.accuracy.values()) / len(self.accuracy) if self.accuracy else None

    @property
    def key(self) -> str:
        return f"{self.method} {self.budget}"


def write_json(rows: list[Row], path: Path, meta: dict[str, Any], comparisons: list | None = None) -> None:
    """Every row (per-sample scores and per-window KL included), the ``--compare`` results and the metadata."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": [asdict(r) | {"mean_accuracy": r.mean_accuracy} for r in rows]}
    payload["comparisons"] = [asdict(c) | {"bytes_ratio": c.bytes_ratio} for c in comparisons or []]
    path.write_text(json.dumps(payload, indent=2))


def _f(x, spec=".3f") -> str:
    return "–" if x is None else format(x, spec)


def _ci(d: PairedDiff | None, spec: str) -> str:
    return "–" if d is None else d.format(spec)


def resident_bytes_per_token(row: Row) -> float:
    """Fast-tier bytes per token (rows from results written before they were recorded: all bytes)."""
    return row.bytes_per_token if row.resident_bytes_per_token is None else row.resident_bytes_per_token


def format_table(rows: list[Row]) -> str:
    """A Markdown table (also readable on a terminal).

    ``*`` marks a paired difference whose 95% CI excludes 0 (with >= 10 pairs).
    """
    tasks = sorted({t for r in rows for t in r.accuracy})
    protocols = {r.protocol for r in rows}
    offloads = any(resident_bytes_per_token(r) != r.bytes_per_token for r in rows if not r.error)
    head = [
        "method",
        "budget",
        *(["protocol"] if len(protocols) > 1 else []),
        "B/token",
        *(["resident B/token"] if offloads else []),
        "% fp16",
        *tasks,
        "mean acc",
        "Δacc vs ref [95% CI]",
        "KL [95% CI]",
        "ΔKL vs ref [95% CI]",
        "ppl",
        "prefill s",
        "compress s",
        "peak MB",
        "decode tok/s",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lead = [r.method, r.budget, *([r.protocol] if len(protocols) > 1 else [])]
        if r.error:
            lines.append("| " + " | ".join(lead) + f" | not run: {r.error} |" + " |" * (len(head) - len(lead) - 1))
            continue
        kl_ci = "–" if r.kl_ci is None else f"{r.kl_ci.mean:.4f} [{r.kl_ci.low:.4f}, {r.kl_ci.high:.4f}]"
        cells = [
            *lead,
            f"{r.bytes_per_token:.0f}",
            *([f"{resident_bytes_per_token(r):.0f}"] if offloads else []),
            f"{100 * r.fp16_fraction:.1f}",
            *(_f(r.accuracy.get(t), ".2f") for t in tasks),
            _f(r.mean_accuracy, ".2f"),
            _ci(r.d_acc, ".2f"),
            kl_ci,
            _ci(r.d_kl, ".4f"),
            _f(r.ppl, ".2f"),
            _f(r.prefill_s, ".2f"),
            _f(r.compress_s, ".2f"),
            _f(None if r.peak_bytes is None else r.peak_bytes / 2**20, ".0f"),
            _f(r.decode_tok_s, ".1f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


METRICS = {
    "accuracy": ("mean task accuracy", "acc_ci", "d_acc"),
    "kl": ("next-token KL(full || compressed), nats", "kl_ci", "d_kl"),
}


def plot(rows: list[Row], path: Path, metric: str = "accuracy", title: str = "") -> None:
    """One metric against KV bytes held per token in the fast tier (``resident_bytes_per_token``), with 95% CI
    bars; one line per (method, protocol).

    A filled marker is a row whose paired difference from its reference excludes zero; a hollow one does not
    (or has no reference).
    """
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    label, ci_attr, diff_attr = METRICS[metric]
    fig, ax = plt.subplots(figsize=(7, 4.4))
    series = dict.fromkeys((r.method, r.protocol) for r in rows)
    multi = len({p for _, p in series}) > 1
    for i, (method, protocol) in enumerate(series):
        pts = [r for r in rows if (r.method, r.protocol) == (method, protocol) and not r.error]
        pts = sorted((r for r in pts if getattr(r, ci_attr) is not None), key=resident_bytes_per_token)
        if not pts:
            continue
        x = [resident_bytes_per_token(r) for r in pts]
        ci = [getattr(r, ci_attr) for r in pts]
        y = [c.mean for c in ci]
        err = [[c.mean - c.low for c in ci], [c.high - c.mean for c in ci]]
        color = f"C{i % 10}"
        style = "--" if protocol == "aware" else "-"
        name = f"{method} ({protocol})" if multi else method
        ax.errorbar(x, y, yerr=err, fmt=style, color=color, capsize=3, label=name, alpha=0.9)
        for r, xi, yi in zip(pts, x, y):
            d = getattr(r, diff_attr)
            filled = d is not None and d.significant
            ax.plot(xi, yi, "o", color=color, markerfacecolor=color if filled else "white")
    ax.set(xlabel="KV bytes held per context token (fast tier)", ylabel=label)
    if metric == "accuracy":
        ax.set_ylim(-0.05, 1.05)
    else:
        ax.set_yscale("symlog", linthresh=1e-3)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.set_title(
        (title + "\n" if title else "") + "filled marker: paired difference vs reference excludes 0", fontsize=9
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_report(rows: list[Row], meta: dict[str, Any], plots: list[str], comparisons: list | None = None) -> str:
    """A Markdown section ready to paste into the docs: command, machine, wall time, the table, the ``--compare``
    table, the plots."""
    m = meta.get("machine", {})
    device = m.get("device_name", meta.get("device", "?"))
    lines = [
        f"Command: `{meta.get('command', 'kvbench')}`",
        "",
        f"Model: {meta.get('model', '?')}, {meta.get('dtype', '?')} on {device}; "
        f"profile `{meta.get('profile', '?')}`, protocol(s) {', '.join(meta.get('protocols', []))}; "
        f"{meta.get('samples', 0)} task samples, {meta.get('kl_pairs', 0)} KL windows; seed {meta.get('seed', 0)}.",
        f"Machine: {m.get('platform', '?')}, {m.get('cpu_count', '?')} CPUs, torch {m.get('torch', '?')}, "
        f"transformers {m.get('transformers', '?')}; load average at start {m.get('loadavg', '?')}. "
        f"Wall time {meta.get('wall_s', 0):.0f} s ({meta.get('cells_reused', 0)} cells reused from an earlier run; "
        f"{meta.get('cells_compute_s', 0):.0f} s of cell computation in all).",
        "",
        f"Reference: `{meta.get('reference', 'full')}`. `Δ` columns: mean paired difference (method − reference) "
        "over the same samples (accuracy) or windows (KL) with a seeded bootstrap 95% CI; `*` marks a difference "
        "whose CI excludes 0, never with fewer than 10 pairs (the bootstrap is too narrow there). "
        "`B/token`: KV bytes actually held (`nbytes()`) per context token; `% fp16`: of an uncompressed fp16 cache.",
        "",
        format_table(rows),
        "",
        *(_comparison_section(comparisons) if comparisons else []),
        *(f"![{p}]({p})" for p in plots),
    ]
    return "\n".join(lines) + "\n"


def _comparison_section(comparisons: list) -> list[str]:
    return [
        "Head-to-head (`--compare A:B`): mean paired difference A − B over the same samples (accuracy) and windows "
        "(KL; lower is better), seeded bootstrap 95% CI, `*` when it excludes 0; bytes are per context token in the "
        "fast tier, and `bytes A/B` says whether the two held the same memory.",
        "",
        format_comparisons(comparisons),
        "",
    ]


def format_comparisons(comparisons: list) -> str:
    """A Markdown table of :class:`kvbench.compare.Comparison` s: ``A − B``, bytes of each (fast tier, per context
    token), their ratio, Δacc and ΔKL with 95% CIs (``*``: the interval excludes 0 with at least 10 pairs; a lower KL
    is better)."""
    multi = len({c.protocol for c in comparisons}) > 1
    head = ["A", "B", *(["protocol"] if multi else []), "B/token A", "B/token B", "bytes A/B"]
    head += ["Δacc A − B [95% CI]", "ΔKL A − B [95% CI]"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in comparisons:
        cells = [c.a, c.b, *([c.protocol] if multi else [])]
        cells += [f"{c.a_bytes_per_token:.0f}", f"{c.b_bytes_per_token:.0f}", f"{c.bytes_ratio:.2f}"]
        cells += ["–" if c.d_acc is None else c.d_acc.format(".2f"), "–" if c.d_kl is None else c.d_kl.format(".4f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
