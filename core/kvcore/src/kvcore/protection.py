"""Protected tokens: attention sinks and a recent window, always kept and counted inside the budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.checks import check_int


@dataclass(frozen=True)
class Protection:
    """Which real tokens a selection must keep.

    Parameters
    ----------
    sinks : int
        The first ``sinks`` real tokens of each sequence (StreamingLLM's attention sinks, 4 in the paper).
    recent : int
        The last ``recent`` real tokens (SnapKV's observation window, KIVI's residual buffer).
    """

    sinks: int = 0
    recent: int = 0

    def __post_init__(self) -> None:
        for name in ("sinks", "recent"):
            check_int(name, getattr(self, name), low=0)

    def mask(self, valid: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` bool mask of protected tokens given ``valid`` (``[B, T]`` bool, True = real token)."""
        rank = valid.long().cumsum(-1) - 1
        n = valid.sum(-1, keepdim=True)
        return valid & ((rank < self.sinks) | (rank >= n - self.recent))
