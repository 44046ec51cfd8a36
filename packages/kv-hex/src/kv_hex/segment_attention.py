"""Decode attention over one HEX part read in place, for the CPU (HEX §3.5).

HEX evicts nothing, so every ``(batch row, KV head)`` of a segment holds the same number of entries ``T``, sorted
by ``(head, position)``: the segment is ``S = B·H`` blocks of ``T`` entries, each a code row or a full-precision
row (the heavy hitters are chosen globally across heads and the recent tokens are whole, §3.3, so keys and values
share their full-precision entries and one set of entry maps serves both sides). This module dequantizes each
side straight into one ``[S, T, D]`` block in entry order (the packed bytes scattered into place, then the same
elementwise operations as :func:`kv_hex.kernels.reference.dequantize_part`, so bit-identical rows; the overlay
values and full rows written in) and attends with one softmax. It builds none of the per-entry index maps of
:class:`kv_hex.layout.PartLayout` (statistics rows, overlay offsets, mask slots), which made the reference path cost
several times the attention itself on a CPU.

Decode blocks of one size (append mode writes one segment per ``block_size`` decoded tokens) are attended together
(:func:`segments_attention`): stacked as the batch rows of one segment (:func:`kv_hex.segment.stack_segments`), read
with the query repeated per block and merged by log-sum-exp, so a long decode does not pay a part's fixed cost per
block, on the CPU or through the fused kernel on CUDA. A segment with ragged heads (after an eviction) goes through
the reference path (:func:`kv_hex.kernels.dispatch.part_attention` over its layout).
"""

from __future__ import annotations

import torch

from kv_hex.config import HEXConfig
from kv_hex.kernels import dispatch
from kv_hex.layout import head_columns, residual_layout, segment_layout
from kv_hex.segment import Segment, stack_segments, uniform_length
from kv_hex.uniform import UniformCall, uniform_part
from kvcodec.packing import unpack_unchecked
from kvcore import merge_split_attention

__all__ = ["block_attention", "residual_attention", "segment_attention", "segments_attention", "stackable"]


def block_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention of ``query [B, Hq, Q, D]`` over one block of entries per head.

    Parameters
    ----------
    query : Tensor
        ``[B, Hq, Q, D]``; query head ``h·G + g`` reads KV head ``h`` (GQA).
    keys, values : Tensor
        ``[S, T, D]`` with ``S = B·Hkv`` (``s = b·Hkv + h``), ``T >= 1``.
    scale : float
        Logit scale.
    logits : bool
        Also return the scaled logits.

    Returns
    -------
    out, lse : Tensor
        float32 ``[B, Hq, Q, D]`` and ``[B, Hq, Q]``.
    logits : Tensor or None
        float32 ``[S, G·Q, T]`` (row ``g·Q + q`` is query head ``h·G + g``, query ``q``) with ``logits=True``.
    """
    B, Hq, Q, D = query.shape
    S = keys.shape[0]
    q = query.float().reshape(S, Hq * Q * B // S, D)
    lg = torch.bmm(q, keys.float().transpose(1, 2)).mul_(scale)
    lse = torch.logsumexp(lg, dim=-1)
    out = torch.bmm(torch.exp(lg - lse[..., None]), values.float())
    return out.view(B, Hq, Q, D), lse.view(B, Hq, Q), lg if logits else None


def residual_attention(
    query: torch.Tensor, res: dict, B: int, H: int, bits: int, scale: float, logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention over HEX's fp16 residual (``{"counts", "pos", "k", "v"}``, entries sorted by ``(head, position)``).

    Returns ``(out, lse, logits)`` as :func:`kv_hex.kernels.reference.part_attention` does (``logits`` float32
    ``[N, G·Q]`` in entry order): the rows viewed as ``[S, T, D]`` blocks when every head holds ``T`` of them, else
    through the reference path over the residual's layout."""
    N, D = res["k"].shape
    T = uniform_length(res["counts"], N)
    if T is None:
        return dispatch.part_attention(query, residual_layout(res, B, H, D, bits), scale, logits)
    S = B * H
    out, lse, lg = block_attention(query, res["k"].view(S, T, D), res["v"].view(S, T, D), scale, logits)
    return out, lse, None if lg is None else lg.transpose(1, 2).reshape(S * T, -1)


def _entry_maps(
    cfg: HEXConfig, seg: Segment, kind: str, T: int, slot: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(coded, full, overlay)`` of one side of a segment whose ``S`` heads hold ``T`` entries each: the entry
    indices of its code rows and of its full-precision rows, and the flat ``[S·T·D]`` destinations of its overlay
    values (each coded entry's mask columns for its slot and head, entry after entry, channels ascending; ``None``
    without a mask). ``slot``: ``[S, T]`` mask row of every entry, or ``None`` when entry ``t`` is slot ``t``."""
    H, D = seg.H, seg.D
    S = seg.counts.numel()
    device = seg.pos.device
    full = seg.full(kind)
    coded = torch.nonzero(~full).flatten()
    hcols = head_columns(cfg, seg.n, H, D, device)
    overlay = None
    if hcols.shape[-1]:
        if slot is None:
            cols = hcols.permute(1, 0, 2)[None].expand(S // H, H, T, -1).reshape(S * T, -1)
        else:
            cols = hcols[slot, (torch.arange(S, device=device) % H)[:, None]].view(S * T, -1)
        cols = cols[coded].long()
        overlay = (coded[:, None] * D + cols)[cols >= 0]
    return coded, torch.nonzero(full).flatten(), overlay


def _dequantized(
    cfg: HEXConfig, seg: Segment, kind: str, T: int, slot: torch.Tensor | None, maps: tuple
) -> torch.Tensor:
    """``[S, T, D]`` keys (``"k"``) or values (``"v"``) of a segment whose ``S`` heads hold ``T`` entries each, in
    entry order and the cache dtype: code rows as code times scale plus zero in float32 (no fused multiply-add)
    rounded to the cache dtype, the overlay values written in (HEX §3.5: ``K̂ = M⊙K + (1−M)⊙deq(Q(K))``), the
    full-precision rows copied: exactly the reference's rows. ``maps``: the side's :func:`_entry_maps`."""
    H, D = seg.H, seg.D
    S = seg.counts.numel()
    B = S // H
    coded, full, overlay = maps
    device = coded.device
    codes = getattr(seg, f"{kind}_codes")
    # the packed codes laid out in entry order (a full row's slot stays 0 and is overwritten below): a byte scatter
    packed = torch.zeros(S * T, codes.shape[1], dtype=torch.uint8, device=device)
    packed[coded] = codes
    x = unpack_unchecked(packed, cfg.bits, D).view(S, T, D).float()
    scale, zero = getattr(seg, f"{kind}_scale").float(), getattr(seg, f"{kind}_zero").float()
    if kind == "k":  # per channel, one statistics row per head: [S, D]
        sc, z = scale[:, None, :], zero[:, None, :]
    elif cfg.value_scope == "layer":  # per token, one statistic per (batch row, slot) shared by the row's heads
        if slot is None:  # [B, n], n = T
            sc = scale[:, None, :, None].expand(B, H, T, 1).reshape(S, T, 1)
            z = zero[:, None, :, None].expand(B, H, T, 1).reshape(S, T, 1)
        else:
            row = (torch.arange(S, device=device) // H)[:, None]
            sc, z = scale[row, slot][..., None], zero[row, slot][..., None]
    else:  # per token and head, one statistic per coded entry (a full entry reads any: it is overwritten)
        sc = torch.zeros(S * T, device=device).index_copy_(0, coded, scale).view(S, T, 1)
        z = torch.zeros(S * T, device=device).index_copy_(0, coded, zero).view(S, T, 1)
    rows = getattr(seg, f"{kind}_rows")
    out = x.mul_(sc).add_(z).to(rows.dtype)
    if overlay is not None:
        out.view(-1)[overlay] = getattr(seg, f"{kind}_over")
    out.view(S * T, D)[full] = rows
    return out


def stackable(seg: Segment) -> int | None:
    """Entries per head of a segment that :func:`segments_attention` can stack with others of the same ``n``: every
    head holds all ``n`` slots (entry ``t`` is slot ``t``) and keys and values both hold code rows (HEX's prefill
    segment and decode blocks), else ``None``."""
    T = seg.uniform_length
    coded = seg.k_full.numel() and seg.v_full.numel()
    return T if T and coded and seg.n == T else None


def segments_attention(
    query: torch.Tensor,
    cfg: HEXConfig,
    segs: list[Segment],
    scale: float,
    logits: bool = False,
    stack: Segment | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor] | None]:
    """Attention of ``query [B, Hq, Q, D]`` over several compressed segments of one size at once, in a number of
    operations that does not grow with their number: the segments stacked as the batch rows of one
    (:func:`kv_hex.segment.stack_segments`: their tensors concatenated, nothing re-quantized), attended with the query
    repeated per segment (on CPU read in place by :func:`segment_attention`; on CUDA by the fused kernel over the
    stack's layout) and the per-segment results merged by log-sum-exp. Every segment must be :func:`stackable`
    with the same ``n`` (a decode writes one such segment per ``block_size`` tokens, so a long decode would
    otherwise pay a part's fixed cost per block).

    ``stack``: ``stack_segments(segs)`` when the caller keeps it (``HEXStore`` builds it once per set of blocks).

    Returns ``(out, lse, logits)``: ``logits`` (with ``logits=True``) one float32 ``[N_i, G·Q]`` per segment, in its
    entry order."""
    if any(stackable(s) is None or s.n != segs[0].n for s in segs):
        raise ValueError("segments_attention stacks segments that hold all of their n slots in every head, same n")
    m = len(segs)
    stack = stack_segments(segs) if stack is None else stack
    if dispatch.use_triton(query):
        part = uniform_part(cfg, stack)  # addressed by arithmetic (kv_hex.uniform) when its sides share their flags
        if part is not None:  # the stack's segments addressed in the kernel: no repeated query, one softmax
            out, lse, lg = dispatch.uniform_attention(query, [UniformCall(part, stack=m, seg_logits=logits)], scale)
            lg = lg[0][0]
            return out, lse, None if lg is None else list(lg.split([s.num_entries for s in segs]))
    q = query if m == 1 else query.repeat(m, 1, 1, 1)  # row i·B + b: segment i, batch row b
    if dispatch.use_triton(query):
        out, lse, lg = dispatch.part_attention(q, segment_layout(cfg, stack), scale, logits)
    else:
        out, lse, lg = segment_attention(q, cfg, stack, scale, logits)
    if m > 1:
        B = query.shape[0]
        out, lse = merge_split_attention(out.reshape(m, B, *out.shape[1:]), lse.reshape(m, B, *lse.shape[1:]), 0)
    return out, lse, None if lg is None else list(lg.split([s.num_entries for s in segs]))


def segment_attention(
    query: torch.Tensor, cfg: HEXConfig, seg: Segment, scale: float, logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Attention of ``query [B, Hq, Q, D]`` over one compressed segment, on the CPU (see the module docstring).

    Returns
    -------
    out, lse : Tensor
        float32 ``[B, Hq, Q, D]`` and ``[B, Hq, Q]``, equal (to float32 rounding) to
        :func:`kv_hex.kernels.reference.part_attention` over the segment's layout.
    logits : Tensor or None
        With ``logits=True``: float32 ``[N, G·Q]``, each entry's scaled logits in the segment's entry order.
    """
    N = seg.num_entries
    S = seg.counts.numel()
    T = seg.uniform_length
    if T is None:  # ragged heads: the reference path over the segment's layout
        return dispatch.part_attention(query, segment_layout(cfg, seg), scale, logits)
    D = seg.D
    if not seg.coded:  # every entry a full-precision row, in entry order
        k, v = seg.k_rows.view(S, T, D), seg.v_rows.view(S, T, D)
    else:
        # entry t of every head is slot t when every slot of every row is held; otherwise look the slots up
        slot = None if seg.n == T else seg.slots().view(S, T)
        shared = torch.equal(seg.k_full, seg.v_full)  # HEX: keys and values full at the same entries
        sides = []
        maps = None
        for kind in ("k", "v"):
            if not getattr(seg, f"{kind}_full").numel():  # no flags held: every entry of this side is a full row
                sides.append(getattr(seg, f"{kind}_rows").view(S, T, D))
                continue
            if maps is None or not shared:
                maps = _entry_maps(cfg, seg, kind, T, slot)
            sides.append(_dequantized(cfg, seg, kind, T, slot, maps))
        k, v = sides
    out, lse, lg = block_attention(query, k, v, scale, logits)
    return out, lse, None if lg is None else lg.transpose(1, 2).reshape(N, -1)
