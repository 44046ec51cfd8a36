"""PyTorch references of the HqeKV kernels (the CPU path; same signatures as the Triton kernels).

* :func:`dequantize_side_ref` -- the rows a :class:`~kv_hqekv.kernels.TieredSide` holds, dequantized in its dtype.
* :func:`tiered_attention_ref` / :func:`tiered_attention_row_ref` -- decode attention over mixed tiers, and the
  attention row reduced over the query heads of each KV head.
* :func:`blocked_attention_ref` -- the same attention over a cache addressed by blocks
  (:mod:`kv_hqekv.kernels.blocked`).
* :func:`transcode_ref` -- a lower tier quantized from the held representation (dequantize, then quantize).

The window importance reference is :func:`kv_hqekv.importance.window_importance_ref`.
"""

from __future__ import annotations

import torch

from kv_hqekv.kernels.blocked import BlockedSide, BlockLayout, expand_side
from kv_hqekv.kernels.tiered import FULL_TIER, NO_ENTRY, TieredSide
from kvcodec.packing import unpack_unchecked
from kvcore import QuantizedTensor


def dequantize_side_ref(side: TieredSide) -> torch.Tensor:
    """``[*side.tier.shape, D]`` rows in ``side.dtype``: full rows, code rows dequantized exactly as the store's
    quantizers do (``zero + code·scale`` or ``codebook[code]·scale + zero`` in float32, clamped, rounded), 0 where
    ``tier == 0``."""
    D, dtype = side.head_dim, side.dtype
    tier = side.tier.reshape(-1)
    row, grp = side.row.reshape(-1).long(), side.group.reshape(-1).long()
    out = torch.zeros(tier.numel(), D, dtype=dtype, device=tier.device)
    full = tier == FULL_TIER
    if bool(full.any()):
        out[full] = side.full[row[full]]
    G = side.group_size
    C = D if side.axis == "channel" else -(-D // G)
    fmax = torch.finfo(dtype).max
    for b, t in side.tiers.items():
        sel = tier == b
        if not bool(sel.any()):
            continue
        codes = unpack_unchecked(t.codes[row[sel]], b, D)
        g = grp[sel]
        y = t.codebook.float().to(codes.device)[codes.long()] if t.codebook is not None else codes.float()
        s, z = t.scales[g].float(), t.zeros[g].float()  # [n, C]
        if side.axis == "token":  # channel d reads column d // G: broadcast over [n, C, G], cut back to D
            pad = C * G - D
            y = torch.nn.functional.pad(y, (0, pad)).view(-1, C, G)
            s, z = s[:, :, None], z[:, :, None]
        # the quantizers' order of operations: uniform z + code·s, normalized codebook[code]·s + z
        y = z + y * s if t.codebook is None else y * s + z
        out[sel] = y.reshape(y.shape[0], -1)[:, :D].clamp_(-fmax, fmax).to(dtype)
    return out.view(*side.tier.shape, D)


def tiered_attention_ref(
    query: torch.Tensor, keys: TieredSide, values: TieredSide, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [B, Hq, Q, D]`` over the entries of ``keys``/``values`` (maps ``[B, Hkv, T]``): entries
    with key tier 0 are padding, a value tier 0 under a kept key is ``V = 0``. ``(out, lse)`` float32, equal to
    ``kvcore.reference_attention`` over the dequantized entries (GQA as a batched product, K/V not repeated)."""
    B, Hq, Q, D = query.shape
    H = keys.tier.shape[1]
    g = Hq // H
    k, v = dequantize_side_ref(keys).float(), dequantize_side_ref(values).float()
    logits = query.float().reshape(B, H, g * Q, D) @ k.transpose(-1, -2) * scale
    logits = logits.masked_fill((keys.tier == NO_ENTRY)[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    out = torch.exp(logits - safe[..., None]) @ v
    return out.view(B, Hq, Q, D), lse.view(B, Hq, Q)


def blocked_attention_ref(
    query: torch.Tensor, layout: BlockLayout, keys: BlockedSide, values: BlockedSide, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tiered_attention_ref` over the per-entry maps a block layout stands for
    (:func:`kv_hqekv.kernels.blocked.expand_side`): ``(out, lse)`` float32."""
    return tiered_attention_ref(query, expand_side(layout, keys), expand_side(layout, values), scale)


def tiered_attention_row_ref(query: torch.Tensor, keys: TieredSide, scale: float, lse: torch.Tensor) -> torch.Tensor:
    """``[B, Hkv, T]`` float32: ``Σ_{h ∈ group(hkv)} Σ_q exp(q·k_t·scale - lse[b, h, q])``, the attention
    probabilities of every held entry normalized by ``lse [B, Hq, Q]`` (the store's own, or that of a merged
    attention), summed over the query heads of each KV head and the query rows; 0 on padding and for rows with
    ``lse = -inf``."""
    B, Hq, Q, D = query.shape
    H, _T = keys.tier.shape[1], keys.tier.shape[2]
    g = Hq // H
    k = dequantize_side_ref(keys).float()
    logits = torch.einsum("bhgqd,bhtd->bhgqt", query.float().view(B, H, g, Q, D), k) * scale
    logits = logits.masked_fill((keys.tier == NO_ENTRY)[:, :, None, None, :], float("-inf"))
    lse = lse.float().view(B, H, g, Q, 1)
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0))
    p = torch.where(torch.isfinite(lse), p, 0.0)
    return p.sum(dim=(2, 3))


def seen_by(n: int, m: int, device: torch.device | None = None) -> torch.Tensor:
    """``c_j = min(m, n - j)``: the window queries that see column ``j`` (float32 ``[n]``), the normalizer of the
    window importance (:func:`kv_hqekv.importance.window_importance_ref`)."""
    return (n - torch.arange(n, device=device)).clamp(max=m).float()


def transcode_ref(source: TieredSide, bits: int, axis: str, group_size: int) -> QuantizedTensor:
    """The entries addressed by ``source``'s maps ``[Nu, U]`` (``Nu`` units of ``U`` entries, every map entry
    held) quantized at ``bits`` (4, 2: uniform min-max; 1: normalized) from their held representation: exactly
    ``tier_quantizer(bits, ...).quantize(dequantize_side_ref(source))``, a ``QuantizedTensor [Nu, U, D]``."""
    from kv_hqekv.quantizers import tier_quantizer

    kind = "key" if axis == "channel" else "value"
    return tier_quantizer(bits, kind, group_size).quantize(dequantize_side_ref(source))
