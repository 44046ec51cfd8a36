"""Importance scores, the output of a Scorer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.checks import check_finite, check_tensor


@dataclass(frozen=True)
class Scores:
    """Per-entry importance, higher = keep. float32 and finite (padding entries may hold anything finite).

    Parameters
    ----------
    keys : Tensor
        ``[B, Hkv, T]`` (or ``[L, B, Hkv, T]`` for a global, cross-layer selection) scores of the key entries.
    values : Tensor, optional
        Separate scores for value entries (HqeKV ranks V by importance x range); ``None`` = same as ``keys``.
    """

    keys: torch.Tensor
    values: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_tensor("scores.keys", self.keys, ndim=(3, 4))
        if self.keys.dtype != torch.float32:
            raise TypeError(f"scores.keys must be float32, got {self.keys.dtype}")
        if self.values is not None:
            check_tensor("scores.values", self.values)
            if self.values.shape != self.keys.shape or self.values.dtype != torch.float32:
                raise ValueError(
                    f"scores.values must be float32 of shape {tuple(self.keys.shape)}, "
                    f"got {self.values.dtype} {tuple(self.values.shape)}"
                )
        sides = [t for t in (self.keys, self.values) if t is not None and t.numel()]
        if sides and not bool(torch.stack([torch.isfinite(t).all() for t in sides]).all()):  # one host read
            check_finite("scores.keys", self.keys)
            check_finite("scores.values", self.values)

    @property
    def for_values(self) -> torch.Tensor:
        """The scores that rank value entries."""
        return self.keys if self.values is None else self.values

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.keys.shape)
