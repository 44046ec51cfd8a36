"""Span weights, coarse entries and routing summaries (SEKV §3.2, Eqs. 2–3).

* Eq. 2: ``w_t = H_t / Σ_{k∈S} H_k`` (uniform when the span's surprisal sums to 0 — our choice).
* Coarse entry per KV head: ``k̄_S = Σ_t w_t K_t``, ``v̄_S = Σ_t w_t V_t`` (accelerator-resident).
* Eq. 3: routing summary per query head ``K̄_S = normalize(Σ_t w_t W K_t) = normalize(W k̄_S)`` (linearity).
"""

from __future__ import annotations

import torch

__all__ = ["coarse_entries", "routing_summaries", "span_weights"]


def span_weights(h: torch.Tensor, span_id: torch.Tensor) -> torch.Tensor:
    """Eq. 2 weights of the tokens of one sequence: ``[n]`` float32, 0 for resident tokens (``span_id < 0``)."""
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
    """Segmented weighted reduction: ``[Hkv, n, D]`` keys (or values) -> ``[Hkv, n_spans, D]`` float32 coarse
    entries."""
    H, _, D = x.shape
    in_span = span_id >= 0
    out = torch.zeros(H, n_spans, D, dtype=torch.float32, device=x.device)
    if n_spans:
        out.index_add_(1, span_id[in_span], x[:, in_span].float() * weights[in_span][None, :, None])
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
