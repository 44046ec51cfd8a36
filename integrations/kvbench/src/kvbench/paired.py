"""Pair every kvbench row with its reference and attach bootstrap intervals (:mod:`kvbench.stats`).

The reference is the full cache (the default) or a named base method. A row is paired with the reference row of
the same protocol and the same budget label; when the reference method has a single row per protocol (the full
cache, or a run where every method was matched to one byte target) that row is the reference of all. Accuracy is
paired per task sample, KL per continuation window (against the full cache, whose own KL is 0 on every window).
"""

from __future__ import annotations

from kvbench.report import Row
from kvbench.stats import bootstrap_mean, paired_difference

__all__ = ["pair_rows"]


def pair_rows(rows: list[Row], reference: str = "full", *, seed: int = 0, n_boot: int = 2000) -> list[Row]:
    """Fill ``acc_ci``, ``kl_ci``, ``reference``, ``d_acc`` and ``d_kl`` of every row that ran (in place).

    Parameters
    ----------
    rows : list of Row
        From :func:`kvbench.run.run_grid`; every row carries its per-sample ``scores`` and per-window
        ``window_kl`` in the workload's order.
    reference : str
        Method name of the reference rows (``"full"``, or a base such as ``"snapkv"``); it must be among the rows.
    seed, n_boot
        Bootstrap seed and resamples (:func:`kvbench.stats.bootstrap_mean`).

    Raises
    ------
    ValueError
        When no row of ``reference`` ran.
    """
    refs = [r for r in rows if r.method == reference and not r.error]
    if not refs:
        raise ValueError(f"reference: no row of method {reference!r} ran; rows: {sorted({r.method for r in rows})}")
    for row in rows:
        if row.error:
            continue
        if row.scores:
            row.acc_ci = bootstrap_mean(row.scores, seed=seed, n_boot=n_boot)
        if row.window_kl:
            row.kl_ci = bootstrap_mean(row.window_kl, seed=seed, n_boot=n_boot)
        if row.method == reference:
            continue
        same_protocol = [r for r in refs if r.protocol == row.protocol]
        ref = next((r for r in same_protocol if r.budget == row.budget), None)
        if ref is None and len(same_protocol) == 1:
            ref = same_protocol[0]
        if ref is None:
            continue
        row.reference = ref.key
        if row.scores and len(row.scores) == len(ref.scores):
            row.d_acc = paired_difference(row.scores, ref.scores, seed=seed, n_boot=n_boot)
        if row.window_kl and ref.window_kl and len(row.window_kl) == len(ref.window_kl):
            row.d_kl = paired_difference(row.window_kl, ref.window_kl, seed=seed, n_boot=n_boot)
    return rows
