"""What SentenceKV's scorer and selector pass on besides scores and tiers: the sentence of every token."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcore import Plan, Scores


def _check_ids(owner: str, ids: object, B: int, T: int) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or tuple(ids.shape) != (B, T):
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{owner}.sentence_id must be an int64 tensor [B={B}, T={T}], got {got}")


@dataclass(frozen=True)
class SentenceScores(Scores):
    """:class:`kvcore.Scores` with ``sentence_id`` ``[B, T]`` int64 (the sentence of every token, ``>= 0``)."""

    sentence_id: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.keys.ndim != 3:
            raise ValueError("SentenceScores are one layer's [B, Hkv, T] scores")
        _check_ids("SentenceScores", self.sentence_id, self.keys.shape[0], self.keys.shape[2])


@dataclass(frozen=True)
class SentencePlan(Plan):
    """:class:`kvcore.Plan` with ``sentence_id`` ``[B, T]`` int64, which :class:`SentenceKVStore` keeps per entry."""

    sentence_id: torch.Tensor = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.key_bits.ndim != 3:
            raise ValueError("a SentencePlan is one layer's [B, Hkv, T] plan")
        _check_ids("SentencePlan", self.sentence_id, self.key_bits.shape[0], self.key_bits.shape[2])
