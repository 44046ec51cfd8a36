"""SentenceKV's prefill selection: top-k per head, the sentences passed on to the store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kv_baselines.sentence.plan import SentencePlan, SentenceScores
from kvcore import Budget, Plan, Scores, Selector, TopKSelector
from kvcore.plan import EVICT, FULL


@dataclass(frozen=True)
class SentenceSelector(Selector):
    """``base``'s plan; for :class:`SentenceScores` a :class:`SentencePlan` carrying their sentence ids.

    Parameters
    ----------
    base : kvcore.Selector
        Which entries are kept (default ``kvcore.TopKSelector()``: SnapKV's per-head top-k, as the authors' code).
    """

    base: Selector = field(default_factory=TopKSelector)
    plan_bits: ClassVar[frozenset[int]] = frozenset({EVICT, FULL})

    def __post_init__(self) -> None:
        if not isinstance(self.base, Selector):
            raise TypeError(f"base must implement kvcore.Selector, got {type(self.base).__name__}")

    def select(
        self,
        scores: Scores,
        budget: Budget,
        protected: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> Plan:
        plan = self.base.select(scores, budget, protected, valid)
        if not isinstance(scores, SentenceScores):
            return plan
        return SentencePlan(plan.key_bits, plan.value_bits, plan.full_precision, sentence_id=scores.sentence_id)
