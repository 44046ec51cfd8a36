"""The pending buffer of a layer: raw K/V collected during a prefill and not compressed yet.

This is the engine-specific part of re-planning: transformers hands the cache whole prefill chunks, which are kept
raw (attention over the prompt is exact) and become one ``ScoringContext`` when the layer is compressed. Re-planning
entries a Store already holds is engine-independent and lives in :mod:`kvcore.replan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvcore import ScoringContext


@dataclass
class Pending:
    """Raw, not yet compressed K/V of a layer: ``[B, Hkv, P, D]`` plus ``[B, P]`` positions and validity."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> Pending:
        return Pending(
            torch.cat([self.keys, keys], 2),
            torch.cat([self.values, values], 2),
            torch.cat([self.positions, positions], 1),
            torch.cat([self.valid, valid], 1),
        )

    def select_rows(self, index: torch.Tensor) -> Pending:
        return Pending(
            *(t.index_select(0, index.to(t.device)) for t in (self.keys, self.values, self.positions, self.valid))
        )

    def head(self, n: int) -> Pending:
        """The first ``n`` slots."""
        return Pending(self.keys[:, :, :n], self.values[:, :, :n], self.positions[:, :n], self.valid[:, :n])

    def tensors(self) -> list[torch.Tensor]:
        return [self.keys, self.values, self.positions, self.valid]

    def context(
        self,
        *,
        queries: torch.Tensor | None,
        layer_idx: int,
        extras: Mapping[str, Any] | None = None,
        protect_before: int | None = None,
    ) -> ScoringContext:
        """The pending entries as one ``ScoringContext``, in slot order (extras computed over the collected tokens
        stay aligned); padding is masked out and zeroed (never NaN), entries below ``protect_before`` protected."""
        valid = self.valid
        zero = torch.zeros((), dtype=self.keys.dtype, device=self.keys.device)
        pos = torch.where(valid, self.positions.long(), 0)
        return ScoringContext(
            keys=torch.where(valid[:, None, :, None], self.keys, zero),
            values=torch.where(valid[:, None, :, None], self.values, zero),
            queries=queries,
            positions=pos,
            attention_mask=None if bool(valid.all()) else valid,
            layer_idx=layer_idx,
            extras=dict(extras or {}),
            protected=(valid & (pos < protect_before)) if protect_before else None,
        )
