"""Token surprisal ``H_t = −log p(x_t | x_<t)`` under the served model (SEKV §3.1, Eq. 1).

Computed from the final hidden states and the output embedding in chunks of the vocabulary, with an online
log-sum-exp, so the ``[T, V]`` log-softmax is never materialised (peak ``[T, chunk]``). On CUDA tensors (with Triton
installed) :func:`surprisal_from_hidden` runs the Triton kernel
:func:`kv_sekv.kernels.triton_surprisal.surprisal_triton`; elsewhere kvcore's reference
:func:`kvcore.surprisal.token_surprisal`, which defines the ``"surprisal"`` extra (and which kv-hf's provider of
that extra runs).
"""

from __future__ import annotations

import torch

from kvcore.checks import check_float, check_integer_tensor, check_tensor
from kvcore.surprisal import check_surprisal_args, token_surprisal

from .kernels import dispatch

__all__ = ["surprisal_from_hidden", "surprisal_from_logits"]


def surprisal_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    chunk: int = 8192,
) -> torch.Tensor:
    """Surprisal of every token from the hidden states that predict it (SEKV §3.1, Eq. 1), vocabulary in chunks:
    :func:`kvcore.surprisal.token_surprisal` (same arguments, result and errors), on a GPU by a Triton kernel.

    The arguments are checked as kvcore checks them; then CUDA tensors (with Triton installed) go to the Triton
    kernel :func:`~kv_sekv.kernels.triton_surprisal.surprisal_triton`, others to kvcore's PyTorch reference
    :func:`~kvcore.surprisal.token_surprisal` (same result up to float32 summation order). ``chunk`` is the
    vocabulary step of the PyTorch path (memory ``B·T·chunk`` floats); the kernel's memory does not depend on it.

    Returns
    -------
    Tensor
        ``[B, T]`` float32 surprisal in nats; the first real token of a row and padding are ``0`` (SEKV makes the
        first token an anchor regardless).
    """
    if not (isinstance(hidden, torch.Tensor) and dispatch.use_triton(hidden)):  # kvcore's checks and reference
        return token_surprisal(hidden, weight, input_ids, bias, attention_mask, chunk)
    from .kernels.triton_surprisal import surprisal_triton

    hidden, weight, ids, bias, attention_mask, chunk = check_surprisal_args(
        hidden, weight, input_ids, bias, attention_mask, chunk
    )
    return surprisal_triton(hidden, weight, ids, bias, attention_mask, chunk)


def surprisal_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Reference: ``H_t = −log_softmax(logits[:, t−1])[x_t]`` from full ``[B, T, V]`` logits (tests, training);
    ``input_ids [B, T]`` integer ids in ``[0, V)`` (a ValueError / TypeError naming it otherwise, never a float
    index truncated)."""
    logits = check_float("logits", check_tensor("logits", logits, ndim=3))
    B, T, V = logits.shape
    input_ids = check_integer_tensor("input_ids", input_ids, ndim=2)
    if tuple(input_ids.shape) != (B, T):
        raise ValueError(f"input_ids must be [B={B}, T={T}], got {tuple(input_ids.shape)}")
    if T > 0 and bool(((input_ids < 0) | (input_ids >= V)).any()):
        raise ValueError(f"input_ids must lie in [0, V={V})")
    out = torch.zeros(B, T, dtype=torch.float32, device=logits.device)
    if T >= 2:
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        out[:, 1:] = -logp.gather(-1, input_ids[:, 1:, None].long())[..., 0]
    return out
