"""Span weights, coarse entries and routing summaries (SEKV §3.2, Eqs. 2–3).

* Eq. 2: ``w_t = H_t / Σ_{k∈S} H_k`` (uniform when the span's surprisal sums to 0 — our choice).
* Coarse entry per KV head: ``k̄_S = Σ_t w_t K_t``, ``v̄_S = Σ_t w_t V_t`` (accelerator-resident):
  :func:`coarse_entries`, a segmented weighted reduction (on CUDA the Triton kernel of
  :mod:`kv_sekv.kernels.triton_summaries`, elsewhere the PyTorch reference :func:`coarse_entries_torch`).
* Eq. 3: routing summary per query head ``K̄_S = normalize(Σ_t w_t W K_t) = normalize(W k̄_S)`` (linearity).
"""

from __future__ import annotations

import torch

from kvcore.checks import check_float, check_int, check_integer_tensor, check_tensor, values_checked

from .kernels import dispatch

__all__ = ["coarse_entries", "coarse_entries_torch", "routing_summaries", "span_weights"]


def span_weights(h: torch.Tensor, span_id: torch.Tensor) -> torch.Tensor:
    """Eq. 2 weights (SEKV §3.2) of the tokens of one sequence: ``w_t = H_t / Σ_{k∈S} H_k`` over each span.

    Parameters
    ----------
    h : Tensor
        ``[n]`` surprisal (negative values count as 0).
    span_id : Tensor
        ``[n]`` int64 span of each token, or ``< 0`` for a resident token.

    Returns
    -------
    Tensor
        ``[n]`` float32: the weights, uniform over a span whose surprisal sums to 0 (our choice), 0 for resident
        tokens. Input of :func:`coarse_entries`.
    """
    h = h.float().clamp_min(0.0)
    in_span = span_id >= 0
    out = torch.zeros_like(h)
    if not bool(in_span.any()):
        return out
    m = int(span_id.max()) + 1
    sid = span_id[in_span]
    total = torch.zeros(m, device=h.device).index_add_(0, sid, h[in_span])
    count = torch.bincount(sid, minlength=m).float()
    zero = total[sid] <= 0
    out[in_span] = torch.where(zero, 1.0 / count[sid], h[in_span] / total[sid].clamp_min(1e-30))
    return out


def coarse_entries(x: torch.Tensor, span_id: torch.Tensor, weights: torch.Tensor, n_spans: int) -> torch.Tensor:
    """Coarse entries per span and KV head (SEKV §3.2, Eq. 2–3): ``k̄_S = Σ_{t∈S} w_t K_t`` (or ``v̄_S`` from values).

    The segmented weighted reduction of ``x`` over each span with the Eq. 2 weights. On CUDA tensors (with Triton
    installed) it runs the Triton kernel :func:`~kv_sekv.kernels.triton_summaries.coarse_entries_triton`
    (deterministic, no atomics; except when autograd must track ``x`` or ``weights``), elsewhere the PyTorch
    reference :func:`coarse_entries_torch`; both give the same result up to float32 summation order.

    Parameters
    ----------
    x : Tensor
        ``[Hkv, n, D]`` keys or values, float32, float16 or bfloat16.
    span_id : Tensor
        ``[n]`` integer span of each token, ``0 .. n_spans − 1``, or negative for a resident token (a span's tokens
        need not be consecutive).
    weights : Tensor
        ``[n]`` float Eq. 2 weights (:func:`span_weights`), on ``x``'s device; those of resident tokens are unused.
    n_spans : int
        Number of spans (>= 0).

    Returns
    -------
    Tensor
        ``[Hkv, n_spans, D]`` float32 coarse entries (0 for a span without tokens).

    Raises
    ------
    TypeError
        When an argument has the wrong type or dtype (named in the message).
    ValueError
        When an argument has the wrong shape or device, or (where :func:`kvcore.checks.values_checked`, and always
        on the Triton path) a span id is ``>= n_spans``.
    """
    check_float("x", check_tensor("x", x, ndim=3))
    n = x.shape[1]
    check_integer_tensor("span_id", span_id, ndim=1)
    check_float("weights", check_tensor("weights", weights, ndim=1))
    check_int("n_spans", n_spans, low=0)
    for name, t in (("span_id", span_id), ("weights", weights)):
        if t.shape[0] != n:
            raise ValueError(f"{name} must have shape [n={n}] (the tokens of x), got {tuple(t.shape)}")
        if t.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {t.device}")
    tracked = torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad)
    if dispatch.use_triton(x) and not tracked:
        from .kernels.triton_summaries import coarse_entries_triton

        return coarse_entries_triton(x, span_id, weights, n_spans)
    if values_checked(x) and n and bool((span_id >= n_spans).any()):
        raise ValueError(f"span_id holds span {int(span_id.max())}, but n_spans is {n_spans}")
    return coarse_entries_torch(x, span_id, weights, n_spans)


def coarse_entries_torch(x: torch.Tensor, span_id: torch.Tensor, weights: torch.Tensor, n_spans: int) -> torch.Tensor:
    """PyTorch reference of :func:`coarse_entries` (SEKV §3.2, Eq. 2–3), the CPU path: ``index_add`` of
    ``w_t x_t`` (float32) into the rows of the spans. Same arguments and result; no argument checks.

    Parameters
    ----------
    x : Tensor
        ``[Hkv, n, D]`` keys or values.
    span_id : Tensor
        ``[n]`` integer span of each token (negative: resident).
    weights : Tensor
        ``[n]`` Eq. 2 weights.
    n_spans : int
        Number of spans.

    Returns
    -------
    Tensor
        ``[Hkv, n_spans, D]`` float32 coarse entries.
    """
    H, _, D = x.shape
    in_span = span_id >= 0
    out = torch.zeros(H, n_spans, D, dtype=torch.float32, device=x.device)
    if n_spans:
        w = weights[in_span].float()[None, :, None]
        out.index_add_(1, span_id[in_span].long(), x[:, in_span].float() * w)
    return out


def routing_summaries(coarse_keys: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    """Eq. 3: ``normalize(W^{(h)} k̄_S)`` per query head ``h`` from its KV head's coarse key.

    Parameters
    ----------
    coarse_keys : Tensor
        ``[..., Hkv, m, D]``.
    W : Tensor
        ``[Hq, d′, D]`` routing projections of one layer (``Hq`` a multiple of ``Hkv``).

    Returns
    -------
    Tensor
        ``[..., Hq, m, d′]`` float32 unit vectors (a zero coarse key gives a zero summary).
    """
    Hkv = coarse_keys.shape[-3]
    group = W.shape[0] // Hkv
    k = coarse_keys.float().repeat_interleave(group, dim=-3)
    proj = torch.einsum("hed,...hmd->...hme", W.float(), k)
    return torch.nn.functional.normalize(proj, dim=-1)
