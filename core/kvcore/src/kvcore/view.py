"""What a Store returns to attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcore.attention import reference_attention


@dataclass(frozen=True)
class KVView:
    """Dense, attention-ready view of one layer's cache.

    Attention over a view is ``softmax(q·kᵀ·scale + logit_bias)·v``.

    Parameters
    ----------
    keys, values : Tensor
        ``[B, Hkv, T, D]``; entries of ragged per-head layouts beyond a head's length are zero padding.
    positions : Tensor
        ``[B, Hkv, T]`` int64 true token positions; ``-1`` for padding.
    logit_bias : Tensor
        ``[B, Hkv, T]`` float32 additive bias: 0 for ordinary entries, ``-inf`` for padding, ``log|S|`` for
        SEKV span summaries.
    bias_free : bool
        Set by a Store that knows, without reading it, that ``logit_bias`` is all zero (no padding, no summaries,
        e.g. heads of equal length), so attention can skip the bias without a host read of its values (a host sync
        on a GPU). ``False`` claims nothing.
    """

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    logit_bias: torch.Tensor
    bias_free: bool = False

    @property
    def valid(self) -> torch.Tensor:
        """``[B, Hkv, T]`` bool: entries that are not padding."""
        return self.positions >= 0

    def attend(self, query: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Reference attention of ``query`` (``[B, Hq, Q, D]``) over this view, GQA-aware, in float32.
        Queries attend to every entry (no causal mask among cached entries); returns ``[B, Hq, Q, D]``
        (:func:`kvcore.attention.reference_attention` also returns the log-sum-exp).
        """
        return reference_attention(self, query, scale)[0]
