"""The joint key/value importance scorer of HqeKV (§3.2, Alg. 2)."""

from __future__ import annotations

from typing import ClassVar

import torch

from kv_hqekv.importance import window_importance
from kvcore import Scorer, Scores, ScoringContext
from kvcore.checks import check_int


def token_range(values: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``Range_j = Σ_b Σ_{h ∈ Hkv} (max_d V - min_d V)`` (float32 ``[N]``), padding excluded (§3.2, Eq. 2).

    The quantization loss of a value vector grows with its range (Table 1), so the value metric weighs
    importance by it.
    """
    v = values.float()
    r = v.amax(-1) - v.amin(-1)  # [B, H, N]
    if valid is not None:
        r = r * valid[:, None, :]
    return r.sum(dim=(0, 1))


class HqeKVScorer(Scorer):
    """HqeKV's joint importance (Wang et al. 2025, "HqeKV", §3.2, Alg. 2 l.5-16).

    Key score ``A_j``: the attention of the last ``window`` queries to token ``j`` (causal, float32), summed over
    query heads, window queries and batch rows, divided by the number of window queries that see ``j``
    (:func:`kv_hqekv.importance.window_importance`). Value score ``A_j · Range_j`` with ``Range_j`` the range of
    ``V_j`` over channels summed over KV heads and batch rows (:func:`token_range`). Both are shared by every KV
    head and batch row (Alg. 2 l.9 ranks with ``sum(A, dim=(0, 1))``) and broadcast to ``[B, Hkv, N]``;
    ``share_batch=False`` keeps one ranking per batch row instead.

    Parameters
    ----------
    window : int
        ``m``, number of trailing queries read (paper: 20, App. A.6).
    times_range : bool
        Value score ``A·Range`` (the joint metric); False gives values the key score (Table 6 "w/o range").
    normalize : bool
        Divide by the number of window queries that see each token (authors' code); False is the paper's sum.
    share_batch : bool
        Sum the metric over batch rows (the paper); False ranks each row on its own.
    """

    needs_queries: ClassVar[bool] = True
    query_window: ClassVar[int | None] = 20
    needs_values: ClassVar[bool] = True

    def __init__(
        self, window: int = 20, times_range: bool = True, normalize: bool = True, share_batch: bool = True
    ) -> None:
        check_int("window", window, low=1)
        for name, flag in (("times_range", times_range), ("normalize", normalize), ("share_batch", share_batch)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.window = window
        self.query_window = window  # the adapter captures this many queries (instance value of the declared attribute)
        self.times_range = times_range
        self.normalize = normalize
        self.share_batch = share_batch

    def __repr__(self) -> str:
        return (
            f"HqeKVScorer(window={self.window}, times_range={self.times_range}, normalize={self.normalize}, "
            f"share_batch={self.share_batch})"
        )

    def score(self, ctx: ScoringContext) -> Scores:
        """Key scores ``A`` and value scores ``A·Range``, float32 ``[B, Hkv, N]``."""
        if not isinstance(ctx, ScoringContext):
            raise TypeError(f"ctx must be a kvcore.ScoringContext, got {type(ctx).__name__}")
        if ctx.queries is None:
            raise ValueError("HqeKVScorer needs ctx.queries: the last `window` post-RoPE queries [B, Hq, m, D]")
        B, H, N, _ = ctx.keys.shape
        q = ctx.queries[:, :, -min(self.window, N) :]
        valid = ctx.valid
        a = window_importance(q, ctx.keys, None if bool(valid.all()) else valid, self.normalize)  # [B, N]
        rng = ctx.values.float().amax(-1) - ctx.values.float().amin(-1)  # [B, H, N]
        rng = (rng * valid[:, None, :]).sum(1)  # [B, N]
        if self.share_batch:
            a = a.sum(0, keepdim=True).expand(B, N)
            rng = rng.sum(0, keepdim=True).expand(B, N)
        a = a * valid
        keys = a[:, None, :].expand(B, H, N).contiguous()
        if not self.times_range:
            return Scores(keys)
        return Scores(keys, (a * rng)[:, None, :].expand(B, H, N).contiguous())
