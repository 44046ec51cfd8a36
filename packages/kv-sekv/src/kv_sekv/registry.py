"""The methods kv-sekv registers (entry-point group ``kvcompress.methods``, see :mod:`kvcore.registry`).

``sekv`` takes a budget by ratio (the fraction removed from the accelerator: SEKV's 10 % budget is
``Budget(ratio=0.9)``, the default) and uses the router shipped for SmolLM2-135M; ``sekv-untrained`` is the Table 5
ablation without the trained zoom-in (:mod:`kv_sekv.ablations`).
"""

from __future__ import annotations

from kvcore import Budget, Compressor
from kvcore.registry import Method

from .ablations import sekv_untrained
from .compressor import sekv

__all__ = ["METHODS"]


def _sekv(budget: Budget) -> Compressor:
    return sekv(budget=1.0 - budget.ratio)


def _sekv_untrained(budget: Budget) -> Compressor:
    return sekv_untrained(budget=1.0 - budget.ratio)


METHODS: tuple[Method, ...] = (
    Method(
        "sekv",
        _sekv,
        "SEKV surprisal spans: resident anchors and span summaries, CPU low-rank bases, trained zoom-in (SEKV §3)",
        budgets=frozenset({"ratio"}),
        default=Budget(ratio=0.9),
    ),
    Method(
        "sekv-untrained",
        _sekv_untrained,
        "SEKV ablation (Table 5): the untrained router (fixed W, one tau, every component kept), not the trained one",
        budgets=frozenset({"ratio"}),
        default=Budget(ratio=0.9),
    ),
)
