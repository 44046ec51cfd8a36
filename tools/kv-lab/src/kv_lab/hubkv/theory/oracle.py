"""Sequential greedy oracle and brute force for ``F_sub`` (paper §2.2, §3.1; Nemhauser et al. 1978).

Greedy reaches ``F(S_greedy) >= (1 - 1/e)·max_{|S| <= B} F(S)`` for monotone submodular ``F``.
HubKV does *not* run this (it is sequential); it is the theoretical oracle of §3.1.
"""

from __future__ import annotations

import itertools

from kvcore.checks import check_int

from .coverage import CoverageObjective

__all__ = ["brute_force_select", "greedy_select"]


def _check_budget(budget: int) -> int:
    check_int("budget", budget, low=0)
    return budget


def greedy_select(objective: CoverageObjective, budget: int) -> list[int]:
    """Sequential greedy maximisation of ``F_sub`` under ``|S| <= budget``.

    At each step adds the token with the largest marginal gain ``Δ(k | S)``, ties to the lowest
    index.

    Parameters
    ----------
    objective : CoverageObjective
    budget : int
        ``B >= 0``; capped at ``N``.

    Returns
    -------
    list of int
        Selected indices in selection order.
    """
    budget = min(_check_budget(budget), objective.n)
    chosen: list[int] = []
    for _ in range(budget):
        best, best_gain = -1, float("-inf")
        for k in range(objective.n):
            if k in chosen:
                continue
            g = objective.gain(k, chosen)
            if g > best_gain:
                best, best_gain = k, g
        chosen.append(best)
    return chosen


def brute_force_select(objective: CoverageObjective, budget: int) -> tuple[list[int], float]:
    """Exact ``max_{|S| <= budget} F_sub(S)`` by enumeration (small ``N`` only).

    By monotonicity the optimum is attained at ``|S| = min(budget, N)``.

    Returns
    -------
    subset, value : (list of int, float)
    """
    budget = min(_check_budget(budget), objective.n)
    if objective.n > 20:
        raise ValueError(f"brute force is for N <= 20, got N = {objective.n}")
    best: tuple[int, ...] = ()
    best_val = objective.value(best)
    for subset in itertools.combinations(range(objective.n), budget):
        v = objective.value(subset)
        if v > best_val:
            best, best_val = subset, v
    return list(best), best_val
