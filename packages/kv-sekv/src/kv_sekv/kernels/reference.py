"""PyTorch references of SEKV's decode attention (SEKV §3.3).

* :func:`biased_attention_torch` — Stage 1: attention of the query heads over accelerator-resident entries
  (anchors, short spans, window, coarse span entries) with a per-entry additive logit bias (``log|S|`` on coarse
  entries, ``-inf`` on padding), returning ``(out, lse)`` so Stage 2 can be merged by log-sum-exp.
* :func:`factored_attention_torch` — Stage 2 for one span held as low-rank factors: the logits ``q K̂ᵀ`` are
  ``(q V_K) diag(σ_K) U_Kᵀ`` and the output ``p V̂`` is ``((p U_V) diag(σ_V)) V_Vᵀ``, so ``K̂``/``V̂`` are never
  rebuilt (exact, ``O(|S| r + r d_h)`` per query instead of ``O(|S| d_h)``).
* :func:`factored_attention_batch_torch` — Stage 2 for every expanded (span, KV head) of a decode step at once:
  the factors padded to one batch (zero components, masked tokens), one batched pass, and the parts of each KV
  head merged by log-sum-exp with scatter reductions -- no Python loop over spans in the arithmetic.
"""

from __future__ import annotations

import torch

from kvcore.transfer import from_host

__all__ = [
    "biased_attention_torch",
    "factored_attention_batch_torch",
    "factored_attention_torch",
    "factored_items_torch",
]


def biased_attention_torch(
    keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None, query: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q kᵀ·scale + bias) v`` per query head over its KV head's entries, float32.

    Parameters
    ----------
    keys, values : Tensor
        ``[B, Hkv, N, D]``.
    bias : Tensor or None
        ``[B, Hkv, N]`` float additive logit bias (``-inf`` masks an entry); ``None``: no bias (every entry counts).
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
    logits = q @ keys.float().transpose(-1, -2) * scale
    if bias is not None:
        logits = logits + bias.float()[:, :, None, :]
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


def _pad_factors(factors, L: int, r: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[P, L, r]``, ``[P, r]``, ``[P, r, D]`` float32 zero-padded stacks of ``(U, σ, Vᵀ)`` factors."""
    P = len(factors)
    U = torch.zeros(P, L, r, device=device)
    s = torch.zeros(P, r, device=device)
    V = torch.zeros(P, r, D, device=device)
    for i, (u, sg, vh) in enumerate(factors):
        n, k = u.shape
        U[i, :n, :k] = u
        s[i, :k] = sg
        V[i, :k] = vh
    return U, s, V


def factored_attention_batch_torch(
    query: torch.Tensor,
    key_factors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    value_factors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scale: float,
    group: torch.Tensor,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each group's queries over the union of its spans, every span given as factors.

    Item ``i`` is one span of one KV head: ``key_factors[i] = (U [L_i, r_i], σ [r_i], Vᵀ [r_i, D])`` (a raw span
    is ``(K, 1, I)``), likewise ``value_factors[i]``, attended by ``query[i]`` ``[G, Q, D]`` and belonging to group
    ``group[i]`` (a KV head of a batch row) in ``[0, groups)``. Every item is padded to the largest ``L`` and ``r``
    (zero components add nothing, padded tokens are masked), so the arithmetic is one batched pass; the items of a
    group are merged by log-sum-exp (scatter ``amax`` and sums), which equals one softmax over the group's tokens.

    Returns
    -------
    (out, lse)
        ``[groups, G, Q, D]`` and ``[groups, G, Q]`` float32, equal to :func:`factored_attention_torch` per item
        merged with :func:`kvcore.attention.merge_attention` per group; a group with no item gives ``out = 0``,
        ``lse = -inf``.
    """
    _P, G, Q, _D = query.shape
    item_out, item_lse = factored_items_torch(query, key_factors, value_factors, scale)
    return merge_items(item_out, item_lse, group, groups, G, Q)


def factored_items_torch(
    query: torch.Tensor,
    key_factors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    value_factors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of each item of :func:`factored_attention_batch_torch` over its own span, not merged:
    ``(out [P, G·Q, D], lse [P, G·Q])`` float32 (every item has at least one token, so ``lse`` is finite)."""
    P, G, Q, D = query.shape
    if P == 0:
        return torch.zeros(0, G * Q, D, device=query.device), torch.zeros(0, G * Q, device=query.device)
    Uk, sk, Vk, Uv, sv, Vv, lengths = pad_items(key_factors, value_factors, D, query.device)
    valid = torch.arange(Uk.shape[1], device=query.device)[None, :] < lengths[:, None]  # [P, L]
    q = query.float().reshape(P, G * Q, D)
    qt = (q @ Vk.transpose(-1, -2)) * sk[:, None, :]  # [P, GQ, rk]
    logits = (qt @ Uk.transpose(-1, -2)) * scale  # [P, GQ, L]
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    item_lse = torch.logsumexp(logits, -1)  # [P, GQ], finite: every item has >= 1 token
    p = torch.exp(logits - item_lse[..., None])
    return ((p @ Uv) * sv[:, None, :]) @ Vv, item_lse  # [P, GQ, D], [P, GQ]


def pad_items(key_factors, value_factors, D: int, device) -> tuple[torch.Tensor, ...]:
    """The items of :func:`factored_attention_batch_torch` zero-padded to the largest ``L`` and ranks:
    ``(Uk [P, L, rk], σk [P, rk], Vkᵀ [P, rk, D], Uv [P, L, rv], σv [P, rv], Vvᵀ [P, rv, D], lengths [P])``."""
    L = max(int(u.shape[0]) for u, _, _ in key_factors)
    rk = max(int(u.shape[1]) for u, _, _ in key_factors)
    rv = max(int(u.shape[1]) for u, _, _ in value_factors)
    Uk, sk, Vk = _pad_factors(key_factors, L, rk, D, device)
    Uv, sv, Vv = _pad_factors(value_factors, L, rv, D, device)
    lengths = from_host([int(u.shape[0]) for u, _, _ in key_factors], device)
    return Uk, sk, Vk, Uv, sv, Vv, lengths


def merge_items(
    item_out: torch.Tensor, item_lse: torch.Tensor, group: torch.Tensor, groups: int, G: int, Q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-item attentions ``item_out [P, G·Q, D]``, ``item_lse [P, G·Q]`` merged per group by log-sum-exp (scatter
    ``amax`` and sums): ``(out [groups, G, Q, D], lse [groups, G, Q])``, ``out = 0`` and ``lse = -inf`` for a group
    with no item."""
    P, GQ, D = item_out.shape
    dev = item_out.device
    idx = group.to(dev).long()
    top = torch.full((groups, GQ), float("-inf"), device=dev).scatter_reduce(
        0, idx[:, None].expand(P, GQ), item_lse, reduce="amax"
    )
    w = torch.exp(item_lse - top[idx])  # [P, GQ]
    denom = torch.zeros(groups, GQ, device=dev).index_add_(0, idx, w)
    num = torch.zeros(groups, GQ, D, device=dev).index_add_(0, idx, w[..., None] * item_out)
    seen = denom > 0
    out = torch.where(seen[..., None], num / torch.where(seen, denom, 1.0)[..., None], 0.0)
    lse = torch.where(seen, top + torch.log(torch.where(seen, denom, 1.0)), float("-inf"))
    return out.reshape(groups, G, Q, D), lse.reshape(groups, G, Q)
