"""Reference attention over a :class:`~kvcore.view.KVView`, returning the log-sum-exp, and the merge of partial
attentions (the online-softmax identity used by fused kernels: FlashAttention, Dao et al. 2022, §3.1).

A Store's fused ``attend(query, scale)`` must equal :func:`reference_attention` over its ``read()`` view; an adapter
attends to a store and to the step's own new tokens separately and combines them with :func:`merge_attention`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from kvcore.checks import check_float, check_tensor


class AttendedView(Protocol):
    """What :func:`reference_attention` reads of a view: a :class:`~kvcore.view.KVView` (which calls this module
    from ``KVView.attend``, so this module does not import it) or any object with the same tensors."""

    keys: torch.Tensor  # [B, Hkv, T, D]
    values: torch.Tensor  # [B, Hkv, T, D]
    logit_bias: torch.Tensor  # [B, Hkv, T]


def check_query(query: object, view_heads: int, head_dim: int, batch: int) -> torch.Tensor:
    """``query`` ``[B, Hq, Q, D]`` float with ``Hq`` a multiple of the KV heads; raises ValueError/TypeError."""
    q = check_float("query", check_tensor("query", query, ndim=4))
    B, Hq, _, D = q.shape
    if batch != B or head_dim != D or Hq % view_heads or Hq == 0:
        raise ValueError(
            f"query must be [B={batch}, Hq (a multiple of Hkv={view_heads}), Q, D={head_dim}], got {tuple(q.shape)}"
        )
    return q


def check_scale(scale: object, head_dim: int) -> float:
    """``None`` -> ``1/sqrt(D)``; otherwise a finite positive number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0 (or None for 1/sqrt(D)), got {scale!r}")
    return float(scale)


def reference_attention(
    view: AttendedView, query: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q·kᵀ·scale + bias)·v`` of ``query`` ``[B, Hq, Q, D]`` over ``view``, GQA-aware, in float32.

    Queries attend to every entry (no causal mask among cached entries). Returns ``(out, lse)``: ``out``
    ``[B, Hq, Q, D]`` float32 and ``lse`` ``[B, Hq, Q]`` float32, the natural log of the softmax denominator
    (``-inf`` with ``out = 0`` for a row that sees no entry).
    """
    B, H, _, D = view.keys.shape
    q = check_query(query, H, D, B)
    scale = check_scale(scale, D)
    group = q.shape[1] // H
    k = view.keys.float().repeat_interleave(group, dim=1)
    v = view.values.float().repeat_interleave(group, dim=1)
    bias = view.logit_bias.float().repeat_interleave(group, dim=1)[:, :, None, :]
    logits = q.float() @ k.transpose(-1, -2) * scale + bias
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    weights = torch.exp(logits - safe[..., None])
    return weights @ v, lse


def merge_attention(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attentions over disjoint key sets: ``[(out_i, lse_i)]`` -> ``(out, lse)`` of the union.

    ``out = Σ exp(lse_i - lse) out_i`` with ``lse = logsumexp_i lse_i``; parts with ``lse = -inf`` contribute
    nothing. Shapes ``[..., Q, D]`` / ``[..., Q]``; computed in float32.
    """
    if not parts:
        raise ValueError("merge_attention needs at least one (out, lse) part")
    lses = torch.stack([lse.float() for _, lse in parts])
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    out = sum(torch.exp(l - safe)[..., None] * o.float() for (o, _), l in zip(parts, lses))
    return out, lse


def merge_split_attention(out: torch.Tensor, lse: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_attention` of parts stacked along ``dim``: ``out [..., S, ..., D]`` / ``lse [..., S, ...]``
    (``dim`` indexes ``lse``'s dimensions; ``out`` has the trailing ``D``).

    What a split (Flash-Decoding) kernel returns: one normalized output and log-sum-exp per split of the keys. A
    split that saw nothing (``lse = -inf``) contributes nothing; a row no split saw gets ``out = 0``,
    ``lse = -inf``. Computed in float32, one pass over the stack.
    """
    lse = lse.float()
    d = dim % lse.dim()
    total = torch.logsumexp(lse, dim=d)
    w = torch.exp(lse - torch.where(torch.isfinite(total), total, 0.0).unsqueeze(d)).nan_to_num_(0.0)
    return (w.unsqueeze(-1) * out.float()).sum(d), total
