"""PyTorch reference of SEKV's token surprisal (SEKV §3.1, Eq. 1), the CPU path of
:func:`kv_sekv.surprisal_from_hidden`, and the padding rule it shares with the Triton kernel
(:mod:`kv_sekv.kernels.triton_surprisal`)."""

from __future__ import annotations

import torch

__all__ = ["mask_surprisal", "surprisal_torch"]


def surprisal_torch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    chunk: int = 8192,
) -> torch.Tensor:
    """PyTorch reference of :func:`kv_sekv.surprisal_from_hidden` (SEKV §3.1, Eq. 1): the vocabulary in chunks of
    ``chunk`` entries with an online log-sum-exp, in float32.

    Same arguments and result as :func:`kv_sekv.surprisal_from_hidden`, which checks them before it calls this; a direct
    call assumes checked input.

    Parameters
    ----------
    hidden, weight, input_ids, bias, attention_mask, chunk
        As in :func:`kv_sekv.surprisal_from_hidden`.

    Returns
    -------
    Tensor
        ``[B, T]`` float32 surprisal in nats; the first real token of a row and padding are ``0``.
    """
    B, T, _ = hidden.shape
    V = weight.shape[0]
    ids = input_ids
    out = torch.zeros(B, T, dtype=torch.float32, device=hidden.device)
    if T < 2:
        return out
    h = hidden[:, :-1].float()  # position t-1 predicts token t
    target = ids[:, 1:].long()
    lse = torch.full((B, T - 1), float("-inf"), device=hidden.device)
    picked = (h * weight.float()[target]).sum(-1)
    if bias is not None:
        picked = picked + bias.float()[target]
    for a in range(0, V, chunk):
        logits = h @ weight[a : a + chunk].float().T
        if bias is not None:
            logits = logits + bias[a : a + chunk].float()
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
    out[:, 1:] = lse - picked
    return mask_surprisal(out, attention_mask)


def mask_surprisal(out: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The padding rule shared by both paths: ``out[b, t]`` kept where tokens ``t`` and ``t − 1`` are both real
    (so the first real token of a left-padded row and the padding are ``0``); ``out`` as is without a mask.

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
        return out
    B = out.shape[0]
    mask = attention_mask.to(out.device).bool()
    prev = torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=out.device), mask[:, :-1]], 1)
    return torch.where(mask & prev, out, 0.0)
