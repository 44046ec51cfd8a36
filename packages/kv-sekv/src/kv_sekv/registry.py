"""The methods kv-sekv registers (entry-point group ``kvcompress.methods``, see :mod:`kvcore.registry`).

``sekv`` takes a budget by ratio (the fraction removed from the accelerator: SEKV's 10 % budget is
``Budget(ratio=0.9)``, the default) and uses the router shipped for SmolLM2-135M; ``sekv-short-spans`` cuts spans to
what the zoom share of the budget can reconstruct (``SEKVConfig(max_span="auto")``, our addition); the Table 5
ablations
(:mod:`kv_sekv.ablations`) are ``sekv-untrained`` (no trained zoom-in), ``sekv-no-svd`` (no SVD reconstruction),
``sekv-fixed-spans`` (no entropy-guided segmentation), ``sekv-global-tau`` (one global threshold) and
``sekv-mean-pool`` (mean-pooling summaries); ``sekv-unbounded-spans`` keeps the paper's maximal runs between anchors as
spans (``max_span=None``, the default before issue 40; ``sekv`` cuts them at 64 tokens).
"""

from __future__ import annotations

from kvcore import Budget, Compressor
from kvcore.registry import Method

from .ablations import sekv_fixed_spans, sekv_global_threshold, sekv_mean_pooling, sekv_no_svd, sekv_untrained
from .compressor import sekv
from .config import SEKVConfig

__all__ = ["METHODS"]


def _sekv(budget: Budget) -> Compressor:
    return sekv(budget=1.0 - budget.ratio)


def _sekv_short_spans(budget: Budget) -> Compressor:
    return sekv(budget=1.0 - budget.ratio, config=SEKVConfig(max_span="auto"), name="sekv-short-spans")


def _sekv_unbounded_spans(budget: Budget) -> Compressor:
    return sekv(budget=1.0 - budget.ratio, config=SEKVConfig(max_span=None), name="sekv-unbounded-spans")


def _ablation(build):
    def factory(budget: Budget) -> Compressor:
        return build(budget=1.0 - budget.ratio)

    return factory


_ABLATIONS = (
    ("sekv-untrained", sekv_untrained, "the untrained router (fixed W, one tau, every component kept)"),
    ("sekv-no-svd", sekv_no_svd, "no SVD reconstruction: spans are their coarse entries only"),
    ("sekv-fixed-spans", sekv_fixed_spans, "evenly spaced span boundaries instead of surprisal peaks"),
    ("sekv-global-tau", sekv_global_threshold, "one zoom threshold (the mean trained tau) for every head"),
    ("sekv-mean-pool", sekv_mean_pooling, "mean-pooled span summaries instead of surprisal weights"),
)


METHODS: tuple[Method, ...] = (
    Method(
        "sekv",
        _sekv,
        "SEKV surprisal spans: resident anchors and span summaries, CPU low-rank bases, trained zoom-in (SEKV §3)",
        budgets=frozenset({"ratio"}),
        default=Budget(ratio=0.9),
    ),
    Method(
        "sekv-short-spans",
        _sekv_short_spans,
        "SEKV with spans cut to what the zoom share of the budget can reconstruct (max_span='auto'; our addition)",
        budgets=frozenset({"ratio"}),
        default=Budget(ratio=0.9),
    ),
    *(
        Method(
            name,
            _ablation(build),
            f"SEKV ablation (Table 5): {what}",
            budgets=frozenset({"ratio"}),
            default=Budget(ratio=0.9),
        )
        for name, build, what in _ABLATIONS
    ),
    Method(
        "sekv-unbounded-spans",
        _sekv_unbounded_spans,
        "SEKV with the paper's maximal runs between anchors as spans (max_span=None; the default before issue 40)",
        budgets=frozenset({"ratio"}),
        default=Budget(ratio=0.9),
    ),
)
