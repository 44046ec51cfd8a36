"""The SEKV attention used for training (SEKV §3.4), differentiable in the router's parameters.

Each training sequence is split at ``c``: the prefix ``[0, c)`` is segmented (from the teacher's own surprisal) and
attended the SEKV way by the continuation queries, the continuation attends to itself causally at full resolution
(as decoded tokens do), and prefix queries attend exactly. A transformers attention function (``"sekv_train"``) does
this in every layer of the frozen backbone, so the distillation KL of Eq. 11 is taken on the model's own output at
every continuation position (our reading of "all positions").

Forward of the straight-through estimator (our choice, the paper gives none)::

    o = [Σ_res e_j v_j + Σ_S ( z_S Σ_{t∈S} e_t v̂_t + (1 − z_S) |S| e_S v̄_S )] / (the same with v ≡ 1)

with ``e = exp(q·k·scale)``, ``z_S = 1[α̃_S > τ]`` hard in the forward pass and ``∂z/∂α̃ = 1``, ``∂z/∂τ = −1`` in the
backward pass; every span is reconstructed (``v̂``, ``k̂`` from the gated SVD, Eq. 8, no gradient through the SVD).
Each layer also records what the zoom, reconstruction and budget losses need (Eqs. 12–15).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from ..bases import reconstruction_error, truncated_svd
from ..config import SEKVConfig
from ..router import SEKVRouter
from ..segmentation import Segmentation
from ..summaries import coarse_entries, routing_summaries, span_weights

__all__ = ["SEKVTraining", "sekv_training"]

NAME = "sekv_train"
_ACTIVE: list[SEKVTraining] = []


@dataclass
class SEKVTraining:
    """State of one training forward pass.

    Parameters
    ----------
    router : SEKVRouter
        The router being trained.
    config : SEKVConfig
        ``R_max``, ``w+``, ``ρ``, ``β``.
    split : int
        ``c``: the prefix ``[0, c)`` is compressed, the continuation ``[c, T)`` is scored.
    segs : list of Segmentation
        The prefix segmentation of every batch row.
    surprisal : Tensor
        ``[B, c]`` surprisal of the prefix (span weights, Eq. 2).
    local_window : int
        Mining rule: a continuation query counts for the zoom loss when at least half of its head-mean teacher
        attention lies more than ``local_window`` tokens back (§3.4: "beyond a local window").
    """

    router: SEKVRouter
    config: SEKVConfig
    split: int
    segs: list[Segmentation]
    surprisal: torch.Tensor
    local_window: int = 128
    records: dict[str, list[torch.Tensor]] = field(
        default_factory=lambda: {"zoom": [], "recon": [], "recon_norm": [], "z": [], "m": []}
    )
    svd_cache: dict | None = None
    """Optional cache of span SVDs across steps, keyed by (sequence, layer, span length, keys/values): the factors
    depend only on the frozen backbone and the sequence, not on the router."""
    keys: list[bytes] | None = None
    """Per batch row, a key identifying the sequence in ``svd_cache``."""
    zoom_rate: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Per layer, per batch row: the fraction of (query, span) pairs zoomed per query head ``[Hq]`` (Fig. 5)."""


def _attention(module: Any, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if not _ACTIVE:
        raise RuntimeError("the sekv_train attention runs only inside kv_sekv.train.sekv_training(...)")
    state = _ACTIVE[-1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = sekv_layer(state, int(module.layer_idx), query, key, value, scale)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def sekv_layer(state: SEKVTraining, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """``[B, Hq, T, D]`` attention output of one layer (module docstring); appends the layer's loss record."""
    B, Hq, T, _D = q.shape
    g = Hq // k.shape[1]
    c = state.split
    router = state.router
    kq, vq = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    qf = q.float()
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    # prefix queries: exact causal attention (what the teacher computes)
    lp = qf[:, :, :c] @ kq[:, :, :c].transpose(-1, -2) * scale
    lp = lp.masked_fill(~causal[:c, :c], float("-inf"))
    out_prefix = torch.softmax(lp, -1) @ vq[:, :, :c]
    W, tau = router.W[layer], router.tau[layer]
    outs = [
        _row(state, b, layer, qf[b], k[b].float(), v[b].float(), kq[b], vq[b], scale, W, tau, state.records)
        for b in range(B)
    ]
    out_cont = torch.stack(outs)
    return torch.cat([out_prefix, out_cont], 2)


def _row(state, b, layer, q, k, v, kq, vq, scale, W, tau, rec):
    """Continuation output ``[Hq, T − c, D]`` of one batch row."""
    router, c = state.router, state.split
    Hq, _, D = q.shape
    Hkv = k.shape[0]
    g = Hq // Hkv
    seg = state.segs[b]
    sid = seg.span_id.to(q.device)
    qc = q[:, c:]  # [Hq, Qc, D]
    Qc = qc.shape[1]
    res = (sid < 0).nonzero()[:, 0]
    # continuation keys: causal, full resolution
    lc = qc @ kq[:, c:].transpose(-1, -2) * scale
    lc = lc.masked_fill(~torch.ones(Qc, Qc, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lr = qc @ kq[:, res].transpose(-1, -2) * scale
    parts_l, parts_v = [lr, lc], [vq[:, res], vq[:, c:]]
    m_spans = seg.n_spans
    if m_spans == 0:
        logits = torch.cat(parts_l, -1)
        return torch.softmax(logits, -1) @ torch.cat(parts_v, 1)
    w = span_weights(state.surprisal[b, :c].to(q.device), sid)
    ck, cv = coarse_entries(k[:, :c], sid, w, m_spans), coarse_entries(v[:, :c], sid, w, m_spans)
    summ = routing_summaries(ck, W)  # [Hq, M, d'], differentiable in W
    lens = torch.bincount(sid[sid >= 0], minlength=m_spans)
    log_len = torch.log(lens.float())
    qp = torch.einsum("hed,hqd->hqe", W, qc)
    gate = torch.sigmoid(qp @ summ.transpose(-1, -2) / math.sqrt(W.shape[1]) + log_len)  # [Hq, Qc, M] Eq. 5
    diff = gate - tau[:, None, None]
    z = (diff > 0).float() + diff - diff.detach()  # straight-through
    # gated reconstruction of every span (Eq. 8), token order of `order`
    order = torch.argsort(sid.masked_fill(sid < 0, m_spans), stable=True)[: int(lens.sum())]
    tok_span = sid[order]
    gsum = summ.view(Hkv, g, m_spans, -1).mean(1).detach()
    k_hat = torch.zeros(Hkv, order.numel(), D, device=q.device)
    v_hat = torch.zeros_like(k_hat)
    starts = torch.cumsum(lens, 0) - lens
    for L in torch.unique(lens).tolist():
        grp = (lens == L).nonzero()[:, 0]
        idx = torch.stack([order[int(starts[s]) : int(starts[s]) + L] for s in grp.tolist()])
        slots = torch.stack([torch.arange(int(starts[s]), int(starts[s]) + L, device=q.device) for s in grp.tolist()])
        for x, out, is_value in ((k, k_hat, False), (v, v_hat, True)):
            key = None if state.svd_cache is None or state.keys is None else (state.keys[b], layer, L, is_value)
            if key is not None and key in state.svd_cache:
                U, sig, Vh = state.svd_cache[key]
            else:
                U, sig, Vh = (t.detach() for t in truncated_svd(x[:, idx].detach(), router.config.max_rank))
                if key is not None:
                    state.svd_cache[key] = (U, sig, Vh)
            m = router.gate(sig, gsum[:, grp], is_value)  # [Hkv, n, R]
            rec["recon"].append(reconstruction_error(sig, m).sum())
            rec["recon_norm"].append((sig**2).sum())
            rec["m"].append(m.mean())
            rebuilt = (U * (m * sig)[..., None, :]) @ Vh  # [Hkv, n, L, D]
            out = out.index_put(
                (torch.arange(Hkv, device=q.device)[:, None, None], slots[None].expand(Hkv, -1, -1)),
                rebuilt.reshape(Hkv, len(grp), L, D),
            )
            if is_value:
                v_hat = out
            else:
                k_hat = out
    kh, vh = k_hat.repeat_interleave(g, 0), v_hat.repeat_interleave(g, 0)
    lt = qc @ kh.transpose(-1, -2) * scale  # [Hq, Qc, Ntok]
    lco = qc @ ck.repeat_interleave(g, 0).transpose(-1, -2) * scale + log_len  # |S| e_S
    mx = torch.cat([lr, lc, lt, lco], -1).amax(-1, keepdim=True).detach()
    er, ec, et, eco = (torch.exp(x - mx) for x in (lr, lc, lt, lco))
    zt = z[:, :, tok_span]
    num = er @ vq[:, res] + ec @ vq[:, c:] + (et * zt) @ vh + (eco * (1 - z)) @ cv.repeat_interleave(g, 0)
    den = er.sum(-1) + ec.sum(-1) + (et * zt).sum(-1) + (eco * (1 - z)).sum(-1)
    out = num / den[..., None]
    # zoom targets (Eq. 12) from the teacher's attention over the exact prefix, at mined positions
    with torch.no_grad():
        lt_full = qc @ kq[:, :c].transpose(-1, -2) * scale
        full = torch.softmax(torch.cat([lt_full, lc], -1), -1)
        pos = torch.arange(c, c + Qc, device=q.device)
        far = (torch.arange(c, device=q.device)[None, :] < (pos[:, None] - state.local_window)).float()
        mined = (full[..., :c] * far).sum(-1).mean(0) >= 0.5  # [Qc] head-mean mass beyond the local window
        a = torch.zeros(Hq, Qc, m_spans, device=q.device).index_add_(2, sid[order], full[..., order])
        y = _coverage_targets(a, state.config.rho)
    if bool(mined.any()):
        pw = state.config.pos_weight
        ga = gate[:, mined].clamp(1e-6, 1 - 1e-6)
        bce = -(pw * y[:, mined] * torch.log(ga) + (1 - y[:, mined]) * torch.log(1 - ga))
        rec["zoom"].append(bce.mean())
    rec["z"].append(z.mean())
    state.zoom_rate.setdefault(layer, []).append((diff > 0).float().mean((1, 2)).detach())
    return out


def _coverage_targets(a: torch.Tensor, rho: float) -> torch.Tensor:
    """Eq. 12: ``y_S = 1`` for the smallest set of spans whose teacher mass reaches ``ρ`` of the span mass."""
    srt, idx = torch.sort(a, dim=-1, descending=True, stable=True)
    total = srt.sum(-1, keepdim=True)
    before = torch.cumsum(srt, -1) - srt
    take = before < rho * total  # include spans until the mass before them reaches ρ
    return torch.zeros_like(a).scatter(-1, idx, take.float())


@contextmanager
def sekv_training(model: Any, state: SEKVTraining) -> Iterator[SEKVTraining]:
    """Run ``model`` with the ``"sekv_train"`` attention and ``state`` inside the block (restored afterwards)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    _ACTIVE.append(state)
    try:
        yield state
    finally:
        _ACTIVE.pop()
        model.set_attn_implementation(before)
