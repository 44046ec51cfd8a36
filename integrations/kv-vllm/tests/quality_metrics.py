"""Drift and KL between two runs' greedy tokens and top-k logprobs (vLLM's ``SamplingParams(logprobs=k)`` lists).

A run is ``{"outputs": [{"tokens": [...], "logprobs": [{token: logprob, ...} per step]}, ...]}`` (token keys may be
JSON strings). Definitions (docs/results/2026-11-29-vllm-quality.md):

* first differing step ``n``: the first step whose greedy token differs (``T`` when none); the steps compared are
  ``0..n`` inclusive (up to there both runs saw the same token history);
* drift: max |logprob difference| over tokens in both runs' top-20 lists, over those steps;
* KL: mean over those steps of KL(reference ‖ test) on the reference's top-20 tokens, both renormalised over those
  20; a token missing from the test run's list gets its smallest listed logprob (an upper bound on its logprob).
"""

from __future__ import annotations

import math
from collections.abc import Callable

TOP = 20


def topk(step: dict, k: int = TOP) -> dict[int, float]:
    items = sorted(((int(t), float(lp)) for t, lp in step.items()), key=lambda x: -x[1])
    return dict(items[:k])


def _renorm(d: dict[int, float]) -> dict[int, float]:
    m = max(d.values())
    z = m + math.log(sum(math.exp(v - m) for v in d.values()))
    return {t: v - z for t, v in d.items()}


def kl_top(ref: dict, test: dict | Callable[[int], float], k: int = TOP) -> tuple[float, int]:
    """KL(ref ‖ test) over ref's top-``k`` tokens, renormalised; ``test`` a listed-logprob dict or token -> logprob.

    Returns ``(KL, tokens of the support missing from test's list)``.
    """
    support = topk(ref, k)
    if callable(test):
        q, missing = {t: test(t) for t in support}, 0
    else:
        listed = {int(t): float(v) for t, v in test.items()}
        floor = min(listed.values())
        q = {t: listed.get(t, floor) for t in support}
        missing = sum(t not in listed for t in support)
    lp, lq = _renorm(support), _renorm(q)
    return sum(math.exp(lp[t]) * (lp[t] - lq[t]) for t in support), missing


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def drift(a: list[dict], b: list[dict], upto: int) -> float:
    """Max |logprob difference| over tokens in both top-20 lists over the first ``upto`` steps (0 if none shared)."""
    out = 0.0
    for sa, sb in zip(a[:upto], b[:upto], strict=True):
        ta, tb = topk(sa), topk(sb)
        out = max([out, *(abs(ta[t] - tb[t]) for t in set(ta) & set(tb))])
    return out


def compare(reference: dict, test: dict) -> list[dict]:
    """Per prompt: identical, first_diff (None if identical), steps compared, drift, mean KL, missing tokens."""
    rows = []
    for a, b in zip(reference["outputs"], test["outputs"], strict=True):
        T = len(a["tokens"])
        n = first_divergence(a["tokens"], b["tokens"])
        upto = min(n + 1, T)
        kls, missing = zip(*(kl_top(a["logprobs"][j], b["logprobs"][j]) for j in range(upto)), strict=True)
        rows.append(
            {
                "identical": n == T,
                "first_diff": None if n == T else n,
                "steps": upto,
                "drift": drift(a["logprobs"], b["logprobs"], upto),
                "kl": sum(kls) / upto,
                "missing": sum(missing),
            }
        )
    return rows
