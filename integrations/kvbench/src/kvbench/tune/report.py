"""The frontier table, plot and recommendation of ``kvbench tune`` (the rows are kvbench's :class:`~kvbench.report.Row`;
the JSON is :func:`kvbench.report.write_json` with the search in its metadata)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.report import Row, resident_bytes_per_token
from kvbench.stats import paired_difference
from kvbench.tune.frontier import Choice, pareto, python_line, reaches, registry_spec

__all__ = ["format_frontier", "plot_frontier", "recommendation"]


def _ci(d, spec: str) -> str:
    return "–" if d is None else f"{d.mean:{spec}} [{d.low:{spec}}, {d.high:{spec}}]"


def format_frontier(
    rows: Sequence[Row],
    choice: Choice,
    fixed: set[str],
    *,
    target_bpt: float | None = None,
    tolerance: float = 0.05,
    seed: int = 0,
) -> str:
    """A Markdown table of every row, by held bytes: mark (``★`` winner, ``=`` tie), spec, bytes, KL and task
    accuracy with 95% CIs, ΔKL against the winner (paired per window), decode tok/s, compression ms, whether it
    reaches the target and whether it is on the KL (and accuracy) frontier."""
    front = {id(r) for r in pareto(rows, "kl")}
    acc_front = {id(r) for r in pareto(rows, "accuracy")}
    tasks = any(r.scores for r in rows if not r.error)
    ties = {id(r) for r in choice.ties}
    head = ["", "spec", "B/token", "% fp16", "KL [95% CI]", "ΔKL vs winner [95% CI]"]
    head += ["accuracy [95% CI]"] if tasks else []
    head += ["decode tok/s", "compress ms"]
    head += ["reaches target"] if target_bpt is not None else []
    head += ["frontier"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ok = sorted((r for r in rows if not r.error), key=lambda r: (resident_bytes_per_token(r), r.kl or 0.0))
    best = choice.winner
    for r in ok:
        mark = "★" if r is best else ("=" if id(r) in ties else "")
        d = None
        if best is not None and r is not best and r.window_kl and best.window_kl:
            d = paired_difference(r.window_kl, best.window_kl, seed=seed)
        on = ["KL"] if id(r) in front else []
        on += ["acc"] if tasks and id(r) in acc_front else []
        cells = [
            mark,
            f"`{registry_spec(r, r.method in fixed)}`" if r.method != "full" else "`full` (reference)",
            f"{resident_bytes_per_token(r):.0f}",
            f"{100 * r.fp16_fraction:.1f}",
            _ci(r.kl_ci, ".4f"),
            "–" if d is None else d.format(".4f"),
        ]
        cells += [_ci(r.acc_ci, ".2f")] if tasks else []
        cells += ["–" if r.decode_tok_s is None else f"{r.decode_tok_s:.1f}", f"{1000 * r.compress_s:.1f}"]
        if target_bpt is not None:
            cells.append("yes" if reaches(r, target_bpt, tolerance) else "no")
        cells.append(", ".join(on) or "")
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:
        if r.error:
            lines.append(f"| | `{r.method}` {r.budget} | not run: {r.error} |" + " |" * (len(head) - 3))
    return "\n".join(lines)


def recommendation(choice: Choice, fixed: set[str], goal: str) -> str:
    """The winner as Markdown: what it is, its spec, its line of Python, the ties; or why there is none."""
    best = choice.winner
    if best is None:
        return f"No recommendation for {goal}: {choice.reason}."
    spec = registry_spec(best, best.method in fixed)
    lines = [
        f"Recommendation for {goal}: **`{spec}`** — {resident_bytes_per_token(best):.0f} B/token "
        f"({100 * best.fp16_fraction:.1f}% of fp16), continuation KL {_ci(best.kl_ci, '.4f')} nats.",
        "",
        "```python",
        python_line(best, best.method in fixed),
        "```",
        "",
        f"Registry spec: `{spec}` (`kvbench --methods {spec}`).",
    ]
    if choice.ties:
        names = ", ".join(f"`{registry_spec(r, r.method in fixed)}`" for r in choice.ties)
        lines += ["", f"Not distinguishable from it (paired 95% CI of ΔKL includes 0, or under 10 windows): {names}."]
    return "\n".join(lines)


def plot_frontier(
    rows: Sequence[Row],
    path: Path,
    choice: Choice,
    *,
    fp16_bpt: float,
    target_bpt: float | None = None,
    max_kl: float | None = None,
    title: str = "",
) -> None:
    """KL (and task accuracy, when tasks ran) against held bytes per token: every row with its 95% CI, the Pareto
    frontier as a line, the target (or KL bound) dashed, the winner starred and its ties ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if not r.error]
    tasks = any(r.scores for r in ran)
    panels = [("kl", "continuation KL(full || compressed), nats", "kl_ci")]
    if tasks:
        panels.append(("accuracy", "mean task accuracy", "acc_ci"))
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.0), squeeze=False)
    methods = list(dict.fromkeys(r.method for r in ran))
    ties = {id(r) for r in choice.ties}
    for ax, (metric, label, attr) in zip(axes[0], panels):
        for i, m in enumerate(methods):
            pts = [r for r in ran if r.method == m and getattr(r, attr) is not None]
            if not pts:
                continue
            x = [100 * resident_bytes_per_token(r) / fp16_bpt for r in pts]
            ci = [getattr(r, attr) for r in pts]
            err = [[c.mean - c.low for c in ci], [c.high - c.mean for c in ci]]
            ax.errorbar(x, [c.mean for c in ci], yerr=err, fmt="o", color=f"C{i % 10}", capsize=2, ms=4, label=m)
        front = pareto(ran, metric)
        if front:
            ax.plot(
                [100 * resident_bytes_per_token(r) / fp16_bpt for r in front],
                [getattr(r, attr).mean for r in front],
                "-",
                color="black",
                lw=1,
                alpha=0.6,
                label="Pareto frontier",
            )
        for r in ran:
            if (r is choice.winner or id(r) in ties) and getattr(r, attr) is not None:
                ax.plot(
                    100 * resident_bytes_per_token(r) / fp16_bpt,
                    getattr(r, attr).mean,
                    "*" if r is choice.winner else "o",
                    ms=16 if r is choice.winner else 11,
                    mfc="gold" if r is choice.winner else "none",
                    mec="black",
                    zorder=5,
                )
        if target_bpt is not None:
            ax.axvline(100 * target_bpt / fp16_bpt, ls="--", color="grey", label="target")
        if max_kl is not None and metric == "kl":
            ax.axhline(max_kl, ls="--", color="grey", label="--max-kl")
        ax.set(xlabel="KV bytes held per context token, % of an fp16 cache", ylabel=label)
        if metric == "kl":
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0.0)  # a KL is never negative
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.suptitle((title + "\n" if title else "") + "★ winner, ○ ties (not distinguishable from it)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(meta: dict[str, Any], table: str, advice: str, plot_name: str) -> str:
    """The report: command, model, machine and time, the recommendation, the table and the plot."""
    m = meta.get("machine", {})
    lines = [
        f"Command: `{meta['command']}`",
        "",
        f"Model: {meta['model']}, {meta['dtype']} on {m.get('device_name', meta['device'])}; "
        f"{meta['windows']} windows of {meta['context']} + {meta['continuation']} tokens from "
        f"`{meta['text']}`{meta.get('tasks_line', '')}; seed {meta['seed']}. Wall time {meta['wall_s']:.0f} s "
        f"(estimated {meta['estimate_s']:.0f} s before the search; {meta['cells_reused']} cells reused).",
        "",
        advice,
        "",
        "`★` winner, `=` tie. KL: mean next-token KL(full || compressed) over the continuation windows, seeded "
        "bootstrap 95% CI; ΔKL: paired per window against the winner (`*`: the interval excludes 0 with at least 10 "
        "windows). `B/token`: KV bytes held in the fast tier per context token; decode tok/s: 16 greedy steps over "
        "the compressed cache; compress ms: the compression itself (mean per window).",
        "",
        table,
        "",
        f"![frontier]({plot_name})",
    ]
    if meta.get("dropped"):
        lines[2:2] = ["", f"Dropped to fit --budget-minutes: {', '.join(meta['dropped'])}."]
    return "\n".join(lines) + "\n"
