"""The scoring context: everything a Scorer may look at for one attention layer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvcore.checks import check_bool_mask, check_float, check_tensor

if TYPE_CHECKING:
    from kvcore.budget import Budget


@dataclass(frozen=True)
class ScoringContext:
    """Inputs of ``Scorer.score`` for one layer, at KV-head granularity.

    Parameters
    ----------
    keys, values : Tensor
        ``[B, Hkv, T, D]`` post-RoPE keys and values (never ``repeat_kv``-expanded).
    queries : Tensor, optional
        ``[B, Hq, W, D]`` post-RoPE query window (the last ``W`` prompt queries); ``Hq`` a multiple of ``Hkv``.
    positions : Tensor, optional
        ``[B, T]`` int64 true token positions. Defaults to ``arange(T)``.
    attention_mask : Tensor, optional
        ``[B, T]`` bool, ``True`` for real tokens, ``False`` for padding (left padding in batches).
    layer_idx : int
        Index of the layer in the model.
    extras : Mapping[str, Any]
        Additional inputs a scorer declared in ``needs_extras`` (e.g. ``"surprisal"``: ``[B, T]``).
    budget : Budget, optional
        The budget the selection will use; budget-aware scorers (HubKV) read ``budget.ratio``.
    protected : Tensor, optional
        ``[B, T]`` bool, tokens the selector will always keep (sinks, recent window).
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    layer_idx: int = 0
    extras: Mapping[str, Any] = field(default_factory=dict)
    budget: Budget | None = None
    protected: torch.Tensor | None = None

    def __post_init__(self) -> None:
        k = check_float("keys", check_tensor("keys", self.keys, ndim=4))
        v = check_float("values", check_tensor("values", self.values, ndim=4))
        if k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} must agree on [B, Hkv, T]")
        B, H, T, _ = k.shape
        if T == 0:
            raise ValueError("keys must hold at least one token (T == 0)")
        if self.queries is not None:
            q = check_float("queries", check_tensor("queries", self.queries, ndim=4))
            if q.shape[0] != B or q.shape[-1] != k.shape[-1] or q.shape[1] % H:
                raise ValueError(
                    f"queries {tuple(q.shape)} must be [B={B}, Hq (multiple of Hkv={H}), W, D={k.shape[-1]}]"
                )
        if self.positions is None:
            object.__setattr__(self, "positions", torch.arange(T, device=k.device).expand(B, T))
        else:
            p = check_tensor("positions", self.positions, ndim=2)
            if tuple(p.shape) != (B, T) or p.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"positions must be an integer tensor [B={B}, T={T}], got {p.dtype} {tuple(p.shape)}")
        if self.attention_mask is not None:
            check_bool_mask("attention_mask", self.attention_mask, (B, T))
        if self.protected is not None:
            check_bool_mask("protected", self.protected, (B, T))

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def seq_len(self) -> int:
        return self.keys.shape[2]

    @property
    def valid(self) -> torch.Tensor:
        """``[B, T]`` bool mask of real (non-padding) tokens."""
        if self.attention_mask is None:
            return torch.ones(self.keys.shape[0], self.keys.shape[2], dtype=torch.bool, device=self.keys.device)
        return self.attention_mask.expand(self.keys.shape[0], self.keys.shape[2])
