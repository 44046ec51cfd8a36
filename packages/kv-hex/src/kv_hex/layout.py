"""Addressing of one part of a HEX cache (a compressed segment, or the fp16 residual) for the read and decode
kernels (HEX §3.5: codes, whole full-precision rows and the expander overlay, read without rebuilding a dense cache).

A :class:`PartLayout` views the part's held tensors (nothing is copied) and adds per-entry index maps derived from
what the part holds: for each entry (sorted by ``(seg, pos)``, ``seg = b·H + h``) and each side (keys, values)
whether it is a code row or a full-precision row and which one, which statistics row dequantizes it, and where its
overlay values start. The overlay coordinates come from the static mask as a per-(slot, head) channel list
(:func:`head_columns`, LRU-cached: it depends only on the mask's ``(kind, n, d, ρ, seed)``). Layouts are built for
one call and dropped: the store holds only the segment (its bytes are what ``nbytes`` counts).
"""

from __future__ import annotations

import functools

import torch

from kv_hex.config import HEXConfig
from kv_hex.kernels import dispatch
from kv_hex.kernels.layouts import PartLayout, SideLayout
from kv_hex.segment import Segment, segment_mask

__all__ = [
    "PartLayout",
    "SideLayout",
    "concat_layouts",
    "decode_segment",
    "head_columns",
    "residual_layout",
    "segment_layout",
]


@functools.lru_cache(maxsize=64)
def _head_columns(kind: str, scope: str, rho: float, seed: int | None, n: int, H: int, D: int) -> torch.Tensor:
    cfg = HEXConfig(rho=rho, mask_kind=kind, mask_scope=scope, seed=seed)
    m = segment_mask(cfg, n, H, D, "cpu")
    if m is None:
        return torch.zeros(n, H, 0, dtype=torch.int32)
    cnt = m.sum(-1)
    W = int(cnt.max()) if cnt.numel() else 0
    # ascending channels of each (slot, head) first, then -1: sort "channel if kept else D + channel"
    key = torch.where(m, torch.arange(D), D + torch.arange(D))
    cols = torch.sort(key, dim=-1).values[..., :W]
    return torch.where(cols < D, cols, -1).to(torch.int32).contiguous()


@functools.lru_cache(maxsize=64)
def _head_columns_on(kind: str, scope: str, rho: float, seed: int | None, n: int, H: int, D: int, device: str):
    return _head_columns(kind, scope, rho, seed, n, H, D).to(device)


def head_columns(cfg: HEXConfig, n: int, H: int, D: int, device) -> torch.Tensor:
    """int32 ``[n, H, W]``: the channels (within the head, ascending, ``-1`` padded) the static mask keeps in full
    precision for each (slot, head) of an ``n``-slot segment; ``W`` is the largest count (0 without a mask). Cached
    per device as well: a decode step on a GPU copies nothing from the host for it."""
    return _head_columns_on(cfg.mask_kind, cfg.mask_scope, cfg.rho, cfg.seed, n, H, D, str(torch.device(device)))


def _side(seg: Segment, kind: str, cfg: HEXConfig, segid, slot, hcols, like: SideLayout | None = None) -> SideLayout:
    """One side's addressing; ``like``: the other side's, when both are full precision at the same entries
    (:attr:`Segment.flags_shared`), whose entry maps (``idx``, overlay offsets) this side then shares."""
    if like is not None:
        N = like.idx.numel()
        device = like.idx.device
        idx = like.idx
        # the code rank where coded; 0 at full rows, whose statistics row is read and then overwritten (in range)
        rank_code = idx.clamp(min=0)
    else:
        full = seg.full(kind)
        N = full.numel()
        device = full.device
        rank_full = torch.cumsum(full, 0) - 1
        rank_code = torch.cumsum(~full, 0) - 1
        idx = torch.where(full, -1 - rank_full, rank_code).to(torch.int32)
    zi = torch.zeros(N, dtype=torch.int32, device=device)
    rows = getattr(seg, f"{kind}_rows")
    if getattr(seg, f"{kind}_full").numel() == 0:  # no flags held: every entry is full (no read of the flags)
        empty = torch.zeros(0, dtype=torch.float32, device=device)
        return SideLayout(idx, getattr(seg, f"{kind}_codes"), rows, empty, empty, zi, rows[:0, 0], zi, kind == "k")
    if kind == "k":
        grp = segid
    elif cfg.value_scope == "layer":
        grp = (segid // seg.H) * seg.n + slot
    else:
        grp = rank_code
    if like is not None:
        ooff = like.ooff  # the same mask rows over the same coded entries
    elif hcols.shape[-1]:
        n_over = (hcols[slot, segid % seg.H] >= 0).sum(-1) * ~full
        ooff = torch.cumsum(n_over, 0) - n_over
    else:
        ooff = zi
    scale, zero = getattr(seg, f"{kind}_scale"), getattr(seg, f"{kind}_zero")
    if kind == "v":
        scale, zero = scale.reshape(-1), zero.reshape(-1)
    return SideLayout(
        idx,
        getattr(seg, f"{kind}_codes"),
        rows,
        scale,
        zero,
        grp.to(torch.int32),
        getattr(seg, f"{kind}_over"),
        ooff.to(torch.int32),
        kind == "k",
    )


def _starts(counts: torch.Tensor, T: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(start, count, T)`` of per-head ``counts``: exclusive offsets, int32 counts and the longest head (``T``
    read from ``counts`` unless the caller knows it)."""
    c = counts.long()
    start = torch.cumsum(c, 0) - c
    if T is None:
        T = int(c.max()) if c.numel() else 0
    return start.to(torch.int32), c.to(torch.int32), T


def segment_layout(cfg: HEXConfig, seg: Segment) -> PartLayout:
    """The :class:`PartLayout` of a compressed segment."""
    segid = seg.seg()
    device = seg.pos.device
    if seg.coded:
        slot = seg.slots(segid)
        hcols = head_columns(cfg, seg.n, seg.H, seg.D, device)
    else:
        slot = torch.zeros_like(segid)
        hcols = torch.zeros(1, seg.H, 0, dtype=torch.int32, device=device)
    start, count, T = _starts(seg.counts, seg.longest_head)
    k = _side(seg, "k", cfg, segid, slot, hcols)
    v = _side(seg, "v", cfg, segid, slot, hcols, k if seg.coded and seg.flags_shared else None)
    return PartLayout(
        seg.counts.numel() // seg.H, seg.H, seg.D, cfg.bits, start, count, T, slot.to(torch.int32), hcols, k, v
    )


def decode_segment(cfg: HEXConfig, seg: Segment, bits: int) -> tuple[torch.Tensor, ...]:
    """``(keys [N, D], values [N, D], seg [N], pos [N])`` of a compressed segment reconstructed (full rows
    bit-exact, overlay exact) by the dequantize + overlay-merge kernel
    (:func:`kv_hex.kernels.dispatch.dequantize_part`)."""
    if bits != cfg.bits:
        raise ValueError(f"bits must be the config's code width {cfg.bits}, got {bits}")
    k, v = dispatch.dequantize_part(segment_layout(cfg, seg))
    return k, v, seg.seg(), seg.pos.int()


def residual_layout(res: dict, B: int, H: int, D: int, bits: int, T: int | None = None) -> PartLayout:
    """The :class:`PartLayout` of the fp16 residual (every entry a full-precision row, no overlay); ``T``: the
    longest head's entries or an upper bound of them, when the caller knows it (else read from the counts)."""
    N = int(res["pos"].numel())
    device = res["pos"].device
    start, count, T = _starts(res["counts"], T)
    idx = -1 - torch.arange(N, dtype=torch.int32, device=device)
    zi = torch.zeros(N, dtype=torch.int32, device=device)
    empty = torch.zeros(0, dtype=torch.float32, device=device)
    codes = torch.zeros(0, (D * bits + 7) // 8, dtype=torch.uint8, device=device)
    sides = [SideLayout(idx, codes, res[kind], empty, empty, zi, res[kind][:0, 0], zi, kind == "k") for kind in "kv"]
    hcols = torch.zeros(1, H, 0, dtype=torch.int32, device=device)
    return PartLayout(B, H, D, bits, start, count, T, zi, hcols, sides[0], sides[1])


def _offsets(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for n in sizes:
        out.append(total)
        total += n
    return out


def concat_layouts(parts: list[PartLayout], T: int | None = None) -> tuple[PartLayout, torch.Tensor]:
    """Several parts of one layer (the segments and the residual) as one :class:`PartLayout`, so the decode kernel
    attends to all of them in one launch with one softmax instead of one launch per part and a log-sum-exp merge.

    The tables of the parts are concatenated (codes, full rows, statistics, overlay values, the mask rows' channel
    lists padded to the widest) and every per-entry index is shifted into the concatenation; the entries are
    reordered so that each head's entries stay contiguous (a head's entries of the first part, then of the next).
    Nothing is dequantized. Returns the layout and ``order`` (int64 ``[N]``): combined entry ``i`` is entry
    ``order[i]`` of the parts' entries taken one part after the other. ``T``: the longest head's entries, or an
    upper bound of them (such as the sum of the parts' ``T``), when the caller knows it (else read from the counts).
    """
    first = parts[0]
    if len(parts) == 1:
        return first, torch.arange(first.num_entries, device=first.count.device)
    B, H, D, bits = first.B, first.H, first.D, first.bits
    seg = torch.cat([p.seg() for p in parts])
    order = torch.sort(seg, stable=True).indices  # by head; within a head, part after part and entry order
    count = sum(p.count.long() for p in parts)
    start, count, T = _starts(count, T)
    W = max(p.hcols.shape[-1] for p in parts)
    hcols = torch.cat([torch.nn.functional.pad(p.hcols, (0, W - p.hcols.shape[-1]), value=-1) for p in parts])
    slot_off = _offsets([p.hcols.shape[0] for p in parts])
    slot = torch.cat([p.slot + o for p, o in zip(parts, slot_off)])[order]

    def side(kind: str, like: SideLayout | None = None) -> SideLayout:
        """``like``: the keys' combined side, whose entry maps the values share when every part shares them."""
        sides = [getattr(p, kind) for p in parts]
        grp_off = _offsets([s.scale.shape[0] for s in sides])
        if like is None:
            code_off = _offsets([s.codes.shape[0] for s in sides])
            full_off = _offsets([s.rows.shape[0] for s in sides])
            over_off = _offsets([s.over.numel() for s in sides])
            idx = torch.cat(
                [torch.where(s.idx >= 0, s.idx + c, s.idx - f) for s, c, f in zip(sides, code_off, full_off)]
            )
            idx = idx[order].to(torch.int32)
            ooff = torch.cat([s.ooff + o for s, o in zip(sides, over_off)])[order].to(torch.int32)
        else:  # the same code and full rows and overlay counts in every part: the same offsets
            idx, ooff = like.idx, like.ooff
        grp = torch.cat([torch.where(s.idx >= 0, s.grp + g, 0) for s, g in zip(sides, grp_off)])  # full: any row
        stats = [s for s in sides if s.scale.numel()]
        scale = torch.cat([s.scale for s in stats]) if stats else sides[0].scale
        zero = torch.cat([s.zero for s in stats]) if stats else sides[0].zero
        return SideLayout(
            idx,
            torch.cat([s.codes for s in sides]),
            torch.cat([s.rows for s in sides]),
            scale,
            zero,
            grp[order].to(torch.int32),
            torch.cat([s.over for s in sides]),
            ooff,
            sides[0].per_channel,
        )

    k = side("k")
    shared = all(p.v.idx is p.k.idx and p.v.ooff is p.k.ooff for p in parts)
    v = side("v", k if shared else None)
    return PartLayout(B, H, D, bits, start, count, T, slot.to(torch.int32), hcols, k, v), order
