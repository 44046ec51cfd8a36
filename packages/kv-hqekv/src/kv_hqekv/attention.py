"""Decode attention over the mixed tiers of an :class:`~kv_hqekv.HqeKVStore`, read from the packed codes.

The held entries are split by their (key tier, value tier) pair; each part is one call of
:func:`kvcodec.quantized_attention` (a Triton kernel on CUDA that dequantizes the packed codes in registers with an
online softmax and GQA; its PyTorch reference on CPU) over the codes of one key tier and one value tier plus the
fp16 rows, and the parts are merged exactly with their log-sum-exps (:func:`kvcore.merge_attention`, the
FlashAttention identity). The normalized 1-bit tier fits the uniform kernel exactly: its two levels
``mean ± c·std`` are ``zero' + code·scale'`` with ``zero' = mean - c·std`` and ``scale' = 2c·std``.

This is at most 9 kernel launches per decode step (one per tier pair present), not the single-pass mixed-tier
kernel the paper's CUDA GEMVs amount to; GPU speed is unmeasured.
"""

from __future__ import annotations

import torch

from kvcodec import CodeRows, QuantizedSegment, normal_codebook, quantized_attention
from kvcore import FULL, merge_attention
from kvcore.attention import check_query, check_scale

QUANT = (4, 2, 1)


def _uniform_params(units, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, zeros)`` float32 ``[nu, C]`` of a tier's units in the uniform ``zero + code·scale`` form."""
    s, z = units.scales[: units.nu].flatten(1).float(), units.zeros[: units.nu].flatten(1).float()
    if bits == 1:  # normalized: mean ± c·std  ->  (mean - c·std) + code·(2c·std)
        c = float(normal_codebook(1)[1])
        return 2 * c * s, z - c * s
    return s, z


def mixed_tier_attention(store, query: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [B, Hq, Q, D]`` over everything ``store`` holds; ``(out fp32 [B, Hq, Q, D], lse fp32
    [B, Hq, Q])``, equal to ``kvcore.reference_attention(store.read(), query, scale)`` within float tolerance
    (a value evicted while its key is kept contributes ``V = 0``)."""
    B, H, D = store._shape
    q = check_query(query, H, D, B)
    scale = check_scale(scale, D)
    S = B * H
    T = int(store.seq_lengths().max()) if S else 0
    device = store._parts["k"][0].length.device
    dtype = store._dtype
    q = q.to(device)
    nothing = (
        torch.zeros(q.shape, dtype=torch.float32, device=device),
        torch.full(q.shape[:-1], float("-inf"), device=device),
    )
    if T == 0:
        return nothing
    sides = {}
    for kind in ("k", "v"):
        fp16, *quant = store._parts[kind]
        slots = store._slots(kind)
        n_full = fp16.rows.shape[0]
        full = torch.cat([fp16.rows, torch.zeros(1, D, dtype=dtype, device=device)])  # + a zero row
        tier = torch.zeros(S, T, dtype=torch.uint8, device=device)  # 0: no entry (value evicted)
        row = torch.full((S, T), -1 - n_full, dtype=torch.long, device=device)  # default: the zero row
        group = torch.zeros(S, T, dtype=torch.long, device=device)
        seg, slot = slots[0]
        tier[seg, slot] = FULL
        row[seg, slot] = -1 - torch.arange(seg.numel(), device=device)
        rows = {}
        for b, units, (seg, slot) in zip(QUANT, quant, slots[1:]):
            if units.empty:
                continue
            tier[seg, slot] = b
            row[seg, slot] = torch.arange(units.nr, device=device)
            group[seg, slot] = units.row_unit()
            scales, zeros = _uniform_params(units, b)
            rows[b] = CodeRows(units.codes, scales, zeros, b, units.quantizer.axis, store.block, full)
        sides[kind] = (tier, row, group, rows, full)
    valid = sides["k"][0] != 0
    parts = []
    for kb in QUANT:
        for vb in QUANT:
            ktier, vtier = sides["k"][0], sides["v"][0]
            kin = (ktier == kb) | ((ktier == FULL) & (kb == 4))
            vin = (vtier == vb) | ((vtier != 1) & (vtier != 2) & (vtier != 4) & (vb == 4))
            mask = valid & kin & vin
            if not bool(mask.any()):
                continue
            cr = []
            for kind, b in (("k", kb), ("v", vb)):
                tier, row, group, rows, full = sides[kind]
                code_rows = rows.get(b)
                if code_rows is None:  # no entry of this side holds the tier: an empty code table
                    pw = (D * b + 7) // 8
                    C = D if kind == "k" else -(-D // store.block)
                    empty = torch.zeros(0, C, device=device)
                    axis = "channel" if kind == "k" else "token"
                    code_rows = CodeRows(
                        torch.zeros(0, pw, dtype=torch.uint8, device=device), empty, empty, b, axis, store.block, full
                    )
                r = torch.where(mask & (tier == b), row, torch.where(tier == FULL, row, -1 - (full.shape[0] - 1)))
                g = torch.where(mask & (tier == b), group, 0)
                cr.append((code_rows, r.view(B, H, T), g.view(B, H, T)))
            bias = torch.where(mask, 0.0, float("-inf")).view(B, H, T)
            (ks, kr, kg), (vs, vr, vg) = cr
            parts.append(quantized_attention(q, QuantizedSegment(ks, vs, kr, kg, vr, vg, bias), scale))
    return merge_attention(parts) if parts else nothing
