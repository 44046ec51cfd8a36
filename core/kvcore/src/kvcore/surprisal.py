"""Token surprisal ``H_t = −log p(x_t | x_<t)``: the definition of the standard ``"surprisal"`` extra.

A scorer that reads ``ctx.extras["surprisal"]`` (SEKV's: Abaskohi et al., "SEKV: Resolution-Adaptive KV Cache with
Hierarchical Semantic Memory", §3.1, Eq. 1) and the adapter that supplies it must agree on what it is; this module
is that agreement and its PyTorch reference. The surprisal is computed from the model's final hidden states and its
output embedding, the vocabulary in chunks with an online log-sum-exp, so the ``[T, V]`` log-softmax is never
materialised (peak ``[T, chunk]`` floats). Faster implementations (kv-sekv's Triton kernel,
:func:`kv_sekv.surprisal_from_hidden`) keep this signature and result and are tested against
:func:`token_surprisal`.
"""

from __future__ import annotations

import torch

from kvcore.checks import check_float, check_int, check_integer_tensor, check_tensor

__all__ = ["check_surprisal_args", "mask_surprisal", "token_surprisal"]


def token_surprisal(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    chunk: int = 8192,
) -> torch.Tensor:
    """Surprisal of every token from the hidden states that predict it, vocabulary in chunks (SEKV §3.1, Eq. 1).

    Parameters
    ----------
    hidden : Tensor
        ``[B, T, d_model]`` final hidden states (after the final norm: the input of the LM head).
    weight : Tensor
        ``[V, d_model]`` output embedding; logits are ``hidden @ weight.T (+ bias)``.
    input_ids : Tensor
        ``[B, T]`` integer token ids in ``[0, V)``.
    bias : Tensor, optional
        ``[V]`` LM-head bias.
    attention_mask : Tensor, optional
        ``[B, T]`` (True / 1 = real token; left padding 0).
    chunk : int
        Vocabulary entries per step (memory ``B·T·chunk`` floats).

    Returns
    -------
    Tensor
        ``[B, T]`` float32 surprisal in nats, ``H_t = −log softmax(logits_{t−1})[x_t]`` (clamped at 0 against
        rounding). The first real token of a row (nothing predicts it) and padding are ``0``.

    Raises
    ------
    ValueError
        On a shape mismatch, ids outside ``[0, V)`` or ``chunk < 1``.
    TypeError
        On non-float hidden states or weight, or non-integer ids.
    """
    hidden, weight, input_ids, bias, attention_mask, chunk = check_surprisal_args(
        hidden, weight, input_ids, bias, attention_mask, chunk
    )
    B, T, _ = hidden.shape
    out = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    if T < 2:
        return out
    h = hidden[:, :-1].float()  # position t-1 predicts token t
    target = input_ids[:, 1:].to(hidden.device).long()
    lse = torch.full((B, T - 1), float("-inf"), device=hidden.device)
    picked = (h * weight.float()[target]).sum(-1)
    if bias is not None:
        picked = picked + bias.float()[target]
    for a in range(0, weight.shape[0], chunk):  # the vocabulary in chunks, an online log-sum-exp in float32
        logits = h @ weight[a : a + chunk].float().T
        if bias is not None:
            logits = logits + bias[a : a + chunk].float()
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
    out[:, 1:] = lse - picked
    return mask_surprisal(out, attention_mask)


def check_surprisal_args(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    bias: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    chunk: int,
) -> tuple:
    """The arguments of :func:`token_surprisal`, checked (same errors); returned as they were given."""
    hidden = check_float("hidden", check_tensor("hidden", hidden, ndim=3))
    weight = check_float("weight", check_tensor("weight", weight, ndim=2))
    ids = check_integer_tensor("input_ids", input_ids, ndim=2)
    chunk = check_int("chunk", chunk, low=1)
    B, T, Dm = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != Dm:
        raise ValueError(f"weight must be [V, d_model={Dm}], got {tuple(weight.shape)}")
    if tuple(ids.shape) != (B, T):
        raise ValueError(f"input_ids must be [B={B}, T={T}], got {tuple(ids.shape)}")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must be [V={V}], got {tuple(bias.shape)}")
    if T > 0 and bool(((ids < 0) | (ids >= V)).any()):
        raise ValueError(f"input_ids must lie in [0, V={V})")
    if attention_mask is not None:
        attention_mask = check_tensor("attention_mask", attention_mask, ndim=2)
        if tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask must be [B={B}, T={T}], got {tuple(attention_mask.shape)}")
    return hidden, weight, ids, bias, attention_mask, chunk


def mask_surprisal(out: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The last step every implementation shares: ``out[b, t]`` kept where tokens ``t`` and ``t − 1`` are both real
    (so the first real token of a left-padded row and the padding are ``0``; every entry kept without a mask), and
    clamped at 0 (a token of probability ~1 may come out a hair below it by rounding).

    Parameters
    ----------
    out : Tensor
        ``[B, T]`` float32 surprisal, ``0`` at ``t = 0``.
    attention_mask : Tensor, optional
        ``[B, T]`` (True / 1 = real token), already checked.

    Returns
    -------
    Tensor
        ``[B, T]`` float32.
    """
    if attention_mask is None:
        return out.clamp_min(0.0)
    B = out.shape[0]
    mask = attention_mask.to(out.device).bool()
    prev = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=out.device), mask[:, :-1]], 1)
    return torch.where(mask & prev, out, 0.0).clamp_min(0.0)
