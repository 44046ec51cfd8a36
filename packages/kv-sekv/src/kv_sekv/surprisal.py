"""Token surprisal ``H_t = −log p(x_t | x_<t)`` under the served model (SEKV §3.1, Eq. 1).

Computed from the final hidden states and the output embedding in chunks of the vocabulary, with an online
log-sum-exp, so the ``[T, V]`` log-softmax is never materialised (peak ``[T, chunk]``). On CUDA tensors (with Triton
installed) :func:`surprisal_from_hidden` runs the Triton kernel
:func:`kv_sekv.kernels.triton_surprisal.surprisal_triton`; elsewhere the PyTorch reference :func:`surprisal_torch`.
"""

from __future__ import annotations

import torch

from kvcore.checks import check_float, check_int, check_tensor

from .kernels import dispatch
from .kernels.surprisal import surprisal_torch

__all__ = ["surprisal_from_hidden", "surprisal_from_logits", "surprisal_torch"]


def surprisal_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    chunk: int = 8192,
) -> torch.Tensor:
    """Surprisal of every token from the hidden states that predict it (SEKV §3.1, Eq. 1), vocabulary in chunks.

    The arguments are checked here; then CUDA tensors (with Triton installed) go to the Triton kernel
    :func:`~kv_sekv.kernels.triton_surprisal.surprisal_triton`, others to the PyTorch reference
    :func:`surprisal_torch` (same result).

    Parameters
    ----------
    hidden : Tensor
        ``[B, T, d_model]`` final hidden states (after the final norm, the input of the LM head).
    weight : Tensor
        ``[V, d_model]`` output embedding; logits are ``hidden @ weight.T (+ bias)``.
    input_ids : Tensor
        ``[B, T]`` token ids.
    bias : Tensor, optional
        ``[V]`` LM-head bias.
    attention_mask : Tensor, optional
        ``[B, T]`` (True / 1 = real token, left padding 0).
    chunk : int
        Vocabulary entries per step of the PyTorch path (memory ``B·T·chunk`` floats); the kernel's memory does not
        depend on it.

    Returns
    -------
    Tensor
        ``[B, T]`` float32 surprisal in nats: ``H_t = −log softmax(logits_{t−1})[x_t]``. The first real token of a
        row (nothing predicts it) and padding are ``0``; SEKV makes the first token an anchor regardless.

    Raises
    ------
    ValueError
        On a shape mismatch, ids outside ``[0, V)`` or ``chunk < 1``.
    TypeError
        On non-float hidden states or weight, or non-integer ids.
    """
    hidden = check_float("hidden", check_tensor("hidden", hidden, ndim=3))
    weight = check_float("weight", check_tensor("weight", weight, ndim=2))
    ids = check_tensor("input_ids", input_ids, ndim=2)
    chunk = check_int("chunk", chunk, low=1)
    B, T, Dm = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != Dm:
        raise ValueError(f"weight must be [V, d_model={Dm}], got {tuple(weight.shape)}")
    if tuple(ids.shape) != (B, T):
        raise ValueError(f"input_ids must be [B={B}, T={T}], got {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got {ids.dtype}")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must be [V={V}], got {tuple(bias.shape)}")
    if T > 0 and bool(((ids < 0) | (ids >= V)).any()):
        raise ValueError(f"input_ids must lie in [0, V={V})")
    if attention_mask is not None:
        attention_mask = check_tensor("attention_mask", attention_mask, ndim=2)
        if tuple(attention_mask.shape) != (B, T):
            raise ValueError(f"attention_mask must be [B={B}, T={T}], got {tuple(attention_mask.shape)}")
    if dispatch._use_triton(hidden):
        from .kernels.triton_surprisal import surprisal_triton

        return surprisal_triton(hidden, weight, ids, bias, attention_mask, chunk)
    return surprisal_torch(hidden, weight, ids, bias, attention_mask, chunk)


def surprisal_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference: ``H_t = −log_softmax(logits[:, t−1])[x_t]`` from full ``[B, T, V]`` logits (tests, training)."""
    logits = check_float("logits", check_tensor("logits", logits, ndim=3))
    B, T, _ = logits.shape
    out = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
    if T >= 2:
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        out[:, 1:] = -logp.gather(-1, input_ids[:, 1:, None].long())[..., 0]
    return out
