"""PyTorch references of SEKV's decode attention (SEKV §3.3).

* :func:`biased_attention_torch` — Stage 1: attention of the query heads over accelerator-resident entries
  (anchors, short spans, window, coarse span entries) with a per-entry additive logit bias (``log|S|`` on coarse
  entries, ``-inf`` on padding), returning ``(out, lse)`` so Stage 2 can be merged by log-sum-exp.
* :func:`factored_attention_torch` — Stage 2 for one span held as low-rank factors: the logits ``q K̂ᵀ`` are
  ``(q V_K) diag(σ_K) U_Kᵀ`` and the output ``p V̂`` is ``((p U_V) diag(σ_V)) V_Vᵀ``, so ``K̂``/``V̂`` are never
  rebuilt (exact, ``O(|S| r + r d_h)`` per query instead of ``O(|S| d_h)``).
"""

from __future__ import annotations

import torch

__all__ = ["biased_attention_torch", "factored_attention_torch"]


def biased_attention_torch(
    keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, query: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q kᵀ·scale + bias) v`` per query head over its KV head's entries, float32.

    Parameters
    ----------
    keys, values : Tensor
        ``[B, Hkv, N, D]``.
    bias : Tensor
        ``[B, Hkv, N]`` float additive logit bias (``-inf`` masks an entry).
    query : Tensor
        ``[B, Hq, Q, D]``, ``Hq`` a multiple of ``Hkv`` (query head ``j`` reads KV head ``j // (Hq/Hkv)``).
    scale : float
        Logit scale.

    Returns
    -------
    (out, lse)
        ``[B, Hq, Q, D]`` and ``[B, Hq, Q]`` float32; a row with no finite logit gives ``out = 0``, ``lse = -inf``.
    """
    B, Hkv, _N, D = keys.shape
    Hq, Q = query.shape[1], query.shape[2]
    g = Hq // Hkv
    q = query.float().reshape(B, Hkv, g * Q, D)
    logits = q @ keys.float().transpose(-1, -2) * scale + bias.float()[:, :, None, :]
    lse = torch.logsumexp(logits, -1)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    out = torch.exp(logits - safe[..., None]) @ values.float()
    return out.reshape(B, Hq, Q, D), lse.reshape(B, Hq, Q)


def factored_attention_torch(
    query: torch.Tensor,
    key_factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    value_factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query`` ``[G, Q, D]`` over one span given as factors ``(U [L, r], σ [r], Vᵀ [r, D])`` for its
    keys and its values (a raw span is ``(K, 1, I)``-free: pass ``U = K``, ``σ = 1``, ``Vᵀ = I``). float32.

    Returns ``(out [G, Q, D], lse [G, Q])`` equal to reference attention over ``K̂ = U diag(σ) Vᵀ``,
    ``V̂ = U_V diag(σ_V) V_Vᵀ``.
    """
    Uk, sk, Vk = (t.float() for t in key_factors)
    Uv, sv, Vv = (t.float() for t in value_factors)
    qt = (query.float() @ Vk.transpose(-1, -2)) * sk  # [G, Q, r]
    logits = qt @ Uk.transpose(-1, -2) * scale  # [G, Q, L]
    lse = torch.logsumexp(logits, -1)
    p = torch.exp(logits - lse[..., None])
    out = ((p @ Uv) * sv) @ Vv
    return out, lse
