"""The SEKV attention used for training (SEKV §3.4), differentiable in the router's parameters.

Each training sequence is split at ``c``: the prefix ``[0, c)`` is segmented (from the teacher's own surprisal) and
attended the SEKV way by the continuation queries, and the continuation attends to itself causally at full
resolution (as decoded tokens do). Prefix queries attend exactly, so the student's prefix is the teacher's: the
student runs the backbone on the continuation only, with the prefix keys and values recorded by the teacher pass
(:mod:`.teacher`). A transformers attention function (``"sekv_train"``) does this in every layer of the frozen
backbone, so the distillation KL of Eq. 11 is taken on the model's own output at every continuation position (our
reading of "all positions").

Forward of the straight-through estimator (our choice, the paper gives none)::

    o = [Σ_res e_j v_j + Σ_S ( z_S Σ_{t∈S} e_t v̂_t + (1 − z_S) |S| e_S v̄_S )] / (the same with v ≡ 1)

with ``e = exp(q·k·scale)``, ``z_S = 1[α̃_S > τ]`` hard in the forward pass and ``∂z/∂α̃ = 1``, ``∂z/∂τ = −1`` in the
backward pass; every span is reconstructed (``v̂``, ``k̂`` from the gated SVD, Eq. 8, no gradient through the SVD).

Everything that depends only on the prefix — resident tokens, coarse entries, span SVDs, the teacher's zoom targets —
and the router terms that do not depend on the query — routing summaries (Eq. 3), gates ``g_φ`` and reconstructions
(Eqs. 7–8), the reconstruction loss (Eq. 14) — is computed once per step for all layers at once
(:func:`prepare_training`); each layer's attention then records what the zoom and budget losses need (Eqs. 12–15).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_sekv.bases import reconstruction_error, truncated_svd
from kv_sekv.config import SEKVConfig
from kv_sekv.router import SEKVRouter
from kv_sekv.segmentation import Segmentation
from kv_sekv.summaries import coarse_entries, span_weights

from .teacher import TeacherRecord, zoom_targets

__all__ = ["SEKVTraining", "SpanRow", "prepare_training", "sekv_training"]

NAME = "sekv_train"
_ACTIVE: list[SEKVTraining] = []


@dataclass
class SpanRow:
    """One batch row's compressed prefix, for every layer (``M`` spans, ``N`` span tokens in span order).

    Attributes
    ----------
    res_k, res_v : Tensor
        ``[L, Hkv, n_res, D]`` resident prefix tokens (anchors, short spans, window), exact.
    n_spans : int
        ``M``.
    log_len : Tensor
        ``[M]`` ``log|S|``.
    tok_span : Tensor
        ``[N]`` the span of each reconstructed token.
    ck, cv : Tensor
        ``[L, Hkv, M, D]`` coarse entries (Eq. 2).
    summ : Tensor
        ``[L, Hq, M, d′]`` routing summaries (Eq. 3), differentiable in ``W``.
    k_hat, v_hat : Tensor
        ``[L, Hkv, N, D]`` gated reconstructions (Eq. 8), differentiable in ``g_φ``.
    y : Tensor
        ``[L, Hq, Qc, M]`` zoom targets (Eq. 12) from the teacher's attention.
    mined : Tensor
        ``[L, Qc]`` bool: continuation positions that count for the zoom loss.
    """

    res_k: torch.Tensor
    res_v: torch.Tensor
    n_spans: int
    log_len: torch.Tensor | None = None
    tok_span: torch.Tensor | None = None
    ck: torch.Tensor | None = None
    cv: torch.Tensor | None = None
    summ: torch.Tensor | None = None
    k_hat: torch.Tensor | None = None
    v_hat: torch.Tensor | None = None
    y: torch.Tensor | None = None
    mined: torch.Tensor | None = None


@dataclass
class SEKVTraining:
    """State of one student forward pass.

    Parameters
    ----------
    router : SEKVRouter
        The router being trained.
    config : SEKVConfig
        ``R_max``, ``w+``, ``ρ``, ``β``.
    split : int
        ``c``: the prefix ``[0, c)`` is compressed, the continuation ``[c, T)`` is scored.
    rows : list of SpanRow
        The compressed prefix of every batch row (:func:`prepare_training`).
    """

    router: SEKVRouter
    config: SEKVConfig
    split: int
    rows: list[SpanRow]
    records: dict[str, list[torch.Tensor]] = field(
        default_factory=lambda: {"zoom": [], "recon": [], "recon_norm": [], "z": [], "m": []}
    )
    zoom_rate: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Per layer, per batch row: the fraction of (query, span) pairs zoomed per query head ``[Hq]`` (Fig. 5)."""
    gates: dict[int, list[torch.Tensor]] | None = None
    """When a dict: per layer, per batch row, the gate values ``[Hq, Qc · n_spans]`` (for :func:`calibrate_tau`)."""


def prepare_training(
    router: SEKVRouter,
    teacher: TeacherRecord,
    segs: list[Segmentation],
    surprisal: torch.Tensor,
    local_window: int,
) -> SEKVTraining:
    """The per-step state of the student pass: every row's compressed prefix for all layers at once.

    Parameters
    ----------
    router : SEKVRouter
        The router being trained (its ``W`` and ``g_φ`` enter the graph here).
    teacher : TeacherRecord
        Keys, values and queries of the teacher pass.
    segs : list of Segmentation
        The prefix segmentation of every batch row.
    surprisal : Tensor
        ``[B, c]`` surprisal of the prefix (span weights, Eq. 2).
    local_window : int
        Mining window of the zoom loss (:func:`kv_lab.sekv.teacher.zoom_targets`).

    Returns
    -------
    SEKVTraining
        With the reconstruction and gate-mass records (Eqs. 14–15) already filled in.
    """
    keys, values, queries = teacher.stacked()
    c = teacher.split
    state = SEKVTraining(router, router.config, c, [])
    for b, seg in enumerate(segs):
        state.rows.append(
            _prepare_row(
                state, keys[:, b], values[:, b], queries[:, b], seg, surprisal[b, :c], teacher.scale, local_window
            )
        )
    return state


def _prepare_row(state, keys, values, queries, seg, h, scale, local_window) -> SpanRow:
    router, c = state.router, state.split
    rec = state.records
    L, Hkv, _, D = keys.shape
    Hq = queries.shape[1]
    g = Hq // Hkv
    dev = keys.device
    kp = keys[:, :, :c]
    sid = seg.span_id.to(dev)
    res = (sid < 0).nonzero()[:, 0]
    row = SpanRow(kp[:, :, res], values[:, :, res], seg.n_spans)
    M = seg.n_spans
    if M == 0:
        return row
    w = span_weights(h.to(dev), sid)
    row.ck = coarse_entries(kp.reshape(L * Hkv, c, D), sid, w, M).view(L, Hkv, M, D)
    row.cv = coarse_entries(values.reshape(L * Hkv, c, D), sid, w, M).view(L, Hkv, M, D)
    W = router.W.float()  # [L, Hq, d', D]
    row.summ = torch.nn.functional.normalize(
        torch.einsum("lhed,lhmd->lhme", W, row.ck.repeat_interleave(g, 1)), dim=-1
    )  # Eq. 3, differentiable in W
    gsum = row.summ.detach().view(L, Hkv, g, M, -1).mean(2)
    lens = torch.bincount(sid[sid >= 0], minlength=M)
    row.log_len = torch.log(lens.float())
    order = torch.argsort(sid.masked_fill(sid < 0, M), stable=True)[: int(lens.sum())]
    row.tok_span = sid[order]
    starts = torch.cumsum(lens, 0) - lens
    hats: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    slots_all = []
    for span_len in torch.unique(lens).tolist():
        grp = (lens == span_len).nonzero()[:, 0]
        slots = starts[grp][:, None] + torch.arange(span_len, device=dev)  # [n, |S|] places in span order
        tok = order[slots]
        slots_all.append(slots.reshape(-1))
        for x, is_value in ((kp, False), (values, True)):
            U, sig, Vh = truncated_svd(x[:, :, tok], router.config.max_rank)  # [L, Hkv, n, |S|, R], no grad
            m = router.gate(sig, gsum[:, :, grp], is_value)  # [L, Hkv, n, R]
            rec["recon"].append(reconstruction_error(sig, m).sum())
            rec["recon_norm"].append((sig**2).sum())
            rec["m"].append(m.mean())
            rebuilt = (U * (m * sig)[..., None, :]) @ Vh  # Eq. 8
            hats[is_value].append(rebuilt.reshape(L, Hkv, -1, D))
    back = torch.argsort(torch.cat(slots_all))
    row.k_hat = torch.cat(hats[False], 2)[:, :, back]
    row.v_hat = torch.cat(hats[True], 2)[:, :, back]
    row.y, row.mined = zoom_targets(queries, keys, sid, M, scale, local_window, state.config.rho)
    return row


def _attention(module: Any, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    if not _ACTIVE:
        raise RuntimeError("the sekv_train attention runs only inside kv_lab.sekv.sekv_training(...)")
    state = _ACTIVE[-1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = sekv_layer(state, int(module.layer_idx), query, key, value, scale)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def sekv_layer(state: SEKVTraining, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """``[B, Hq, Qc, D]`` attention output of the continuation queries ``q`` of one layer, whose own keys and values
    are ``k``, ``v`` ``[B, Hkv, Qc, D]`` (module docstring); appends the layer's loss record."""
    outs = [
        _row(state, state.rows[b], layer, q[b].float(), k[b].float(), v[b].float(), scale) for b in range(q.shape[0])
    ]
    return torch.stack(outs)


def _row(state: SEKVTraining, row: SpanRow, layer: int, qc, kc, vc, scale):
    """Continuation output ``[Hq, Qc, D]`` of one batch row."""
    rec = state.records
    Hq, Qc, _ = qc.shape
    g = Hq // kc.shape[0]

    def rep(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(g, 0)

    # continuation keys: causal, full resolution; resident prefix tokens: exact
    lc = qc @ rep(kc).transpose(-1, -2) * scale
    lc = lc.masked_fill(~torch.ones(Qc, Qc, dtype=torch.bool, device=qc.device).tril(), float("-inf"))
    res_v = rep(row.res_v[layer])
    lr = qc @ rep(row.res_k[layer]).transpose(-1, -2) * scale
    if row.n_spans == 0:
        return torch.softmax(torch.cat([lr, lc], -1), -1) @ torch.cat([res_v, rep(vc)], 1)
    router = state.router
    W, tau = router.W[layer], router.tau[layer]
    qp = torch.einsum("hed,hqd->hqe", W, qc)
    gate = torch.sigmoid(qp @ row.summ[layer].transpose(-1, -2) / math.sqrt(W.shape[1]) + row.log_len)  # Eq. 5
    diff = gate - tau[:, None, None]
    z = (diff > 0).float() + diff - diff.detach()  # straight-through
    lt = qc @ rep(row.k_hat[layer]).transpose(-1, -2) * scale  # [Hq, Qc, N]
    lco = qc @ rep(row.ck[layer]).transpose(-1, -2) * scale + row.log_len  # |S| e_S
    zt = z[:, :, row.tok_span]
    with torch.no_grad():  # shift by the max over the terms that count (z is 0 or 1 in the forward): den >= 1
        on = (diff > 0)[:, :, row.tok_span]
        mx = torch.cat([lr, lc, lt.masked_fill(~on, -math.inf), lco.masked_fill(diff > 0, -math.inf)], -1)
        mx = mx.amax(-1, keepdim=True)
    # a term that does not count may lie above the shift: clamped, it stays finite (0 · inf would be NaN)
    er, ec, et, eco = (torch.exp((x - mx).clamp_max(0.0)) for x in (lr, lc, lt, lco))
    num = er @ res_v + ec @ rep(vc) + (et * zt) @ rep(row.v_hat[layer]) + (eco * (1 - z)) @ rep(row.cv[layer])
    den = er.sum(-1) + ec.sum(-1) + (et * zt).sum(-1) + (eco * (1 - z)).sum(-1)
    out = num / den[..., None]
    mined = row.mined[layer]
    if bool(mined.any()):
        pw = state.config.pos_weight
        ga = gate[:, mined].clamp(1e-6, 1 - 1e-6)
        y = row.y[layer][:, mined]
        rec["zoom"].append((-(pw * y * torch.log(ga) + (1 - y) * torch.log(1 - ga))).mean())  # Eq. 13
    rec["z"].append(z.mean())
    state.zoom_rate.setdefault(layer, []).append((diff > 0).float().mean((1, 2)).detach())
    if state.gates is not None:
        state.gates.setdefault(layer, []).append(gate.detach().reshape(Hq, -1))
    return out


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
