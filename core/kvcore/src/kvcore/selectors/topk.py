"""Top-k selection with exact per-head, per-layer or global counts (AdaKV-style per-head floor)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcore.budget import Budget
from kvcore.checks import check_number
from kvcore.plan import EVICT, FULL, Plan
from kvcore.scores import Scores
from kvcore.selectors._ranking import (
    as_scores,
    check_protected_fit,
    kept_per_row,
    prepare,
    stable_rank,
    unflatten,
)
from kvcore.transfer import from_host


@dataclass(frozen=True)
class TopKSelector:
    """Keep the highest-scoring entries; evict the rest.

    ``budget.granularity`` decides where the count is exact: ``"head"`` keeps ``budget.kept(n)`` per KV head
    (SnapKV, kvpress ``ScorerPress``); ``"layer"`` keeps ``H * budget.kept(n)`` per layer, chosen globally over
    its heads; ``"global"`` takes ``[L, B, H, T]`` scores and keeps ``L * H * budget.kept(n)`` per batch row.
    For the last two every head first keeps its own top ``floor(head_floor * budget.kept(n))`` (AdaKV's
    ``alpha_safeguard``; Feng et al. 2024, "Ada-KV", §3).

    Parameters
    ----------
    head_floor : float
        Fraction of the per-head budget guaranteed to each head under ``"layer"`` / ``"global"``, in [0, 1].
        Default 0.2 as in AdaKV.

    Attributes
    ----------
    plan_bits : frozenset of int
        ``{EVICT, FULL}`` (:class:`kvcore.PlanBits`): it keeps or evicts, never quantizes; paired with a quantizing
        store, :class:`kvcore.Compressor` applies the store's own tier policy or refuses the pair.
    """

    plan_bits: ClassVar[frozenset[int]] = frozenset({EVICT, FULL})
    head_floor: float = 0.2

    def __post_init__(self) -> None:
        object.__setattr__(self, "head_floor", check_number("head_floor", self.head_floor, low=0.0, high=1.0))

    def select(
        self,
        scores: Scores,
        budget: Budget,
        protected: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> Plan:
        scores = as_scores(scores)
        keep_k = self._keep(scores.keys, budget, protected, valid)
        keep_v = None if scores.values is None else self._keep(scores.values, budget, protected, valid)
        return Plan.from_keep(keep_k, keep_v)

    def _keep(self, s: torch.Tensor, budget: Budget, protected, valid) -> torch.Tensor:
        if not isinstance(budget, Budget):
            raise TypeError(f"budget must be a kvcore.Budget, got {type(budget).__name__}")
        if (s.ndim == 4) != (budget.granularity == "global"):
            raise ValueError(
                f"granularity {budget.granularity!r} needs scores of rank {4 if budget.granularity == 'global' else 3}"
                f" ([L, B, H, T] for 'global', [B, H, T] otherwise), got {tuple(s.shape)}"
            )
        key, prot, _, n_valid = prepare(s, protected, valid)
        k, kept = kept_per_row(budget, n_valid)  # [B]
        G = key.shape[1]
        if budget.granularity == "head":
            check_protected_fit(prot, k[:, None], "each head")
            keep = stable_rank(key) < k[:, None, None]
        else:
            check_protected_fit(prot.flatten(1), G * k, "each layer" if s.ndim == 3 else "the model")
            floor = from_host([math.floor(self.head_floor * x) for x in kept], k.device, dtype=torch.long)
            floored = stable_rank(key) < floor[:, None, None]
            flat = key.masked_fill(floored, float("inf")).flatten(1)
            keep = (stable_rank(flat) < (G * k)[:, None]).view_as(key)
        return unflatten(keep, s.shape)
