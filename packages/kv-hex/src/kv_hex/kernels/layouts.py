"""The addressing of one part of a HEX layer as the kernels read it: :class:`PartLayout` (per-entry index maps, built
by :mod:`kv_hex.layout` from a segment or the residual) and the layout of a uniform segment addressed by arithmetic
(:func:`as_part_layout`, the definition :mod:`kv_hex.kernels.triton_uniform` is tested against). Plain data and
torch only, so the kernels' references import it without importing the store's modules."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcodec.segments import segment_ids

__all__ = ["PartLayout", "SideLayout", "as_part_layout"]


@dataclass(frozen=True)
class SideLayout:
    """Keys or values of one part.

    Attributes
    ----------
    idx : Tensor
        int32 ``[N]``: ``>= 0`` code row ``idx``, ``< 0`` full-precision row ``-1 - idx`` (code rows and full rows
        are each in entry order: the coded entries' ``idx`` run ``0 .. Nq-1``).
    codes : Tensor
        uint8 ``[Nq, packed_width(D, bits)]`` packed codes (the :mod:`kvcodec.packing` bit stream).
    rows : Tensor
        ``[Nf, D]`` full-precision rows, in the cache dtype (code rows dequantize to it as well).
    scale, zero : Tensor
        ``[Ng, D]`` (``per_channel``: keys, one statistic per channel of the group) or ``[Ng]`` (values, one per
        token group).
    grp : Tensor
        int32 ``[N]``: the statistics row of each coded entry.
    over : Tensor
        ``[No]`` overlay values of the coded entries, entry after entry, channels ascending.
    ooff : Tensor
        int32 ``[N]``: first overlay value of each coded entry in ``over``.
    per_channel : bool
    """

    idx: torch.Tensor
    codes: torch.Tensor
    rows: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    grp: torch.Tensor
    over: torch.Tensor
    ooff: torch.Tensor
    per_channel: bool


@dataclass(frozen=True)
class PartLayout:
    """One part of a HEX layer: ``S = B·H`` ragged heads of entries, addressed for the kernels.

    Attributes
    ----------
    B, H, D : int
        Batch rows, KV heads, head dim.
    bits : int
        Code width (3 or 4 for HEX-3 / HEX-4; any of 2, 3, 4, 8).
    start, count : Tensor
        int32 ``[S]``: first entry and number of entries of each head (entries are contiguous per head).
    T : int
        The largest ``count``.
    slot : Tensor
        int32 ``[N]``: the mask row (segment slot) of each entry.
    hcols : Tensor
        int32 ``[n, H, W]``: the overlay channels of (slot, head), ``-1`` padded (``W = 0``: no overlay).
    k, v : SideLayout
    """

    B: int
    H: int
    D: int
    bits: int
    start: torch.Tensor
    count: torch.Tensor
    T: int
    slot: torch.Tensor
    hcols: torch.Tensor
    k: SideLayout
    v: SideLayout

    @property
    def num_entries(self) -> int:
        return int(self.k.idx.numel())

    @property
    def dtype(self) -> torch.dtype:
        return self.k.rows.dtype

    def seg(self) -> torch.Tensor:
        """int64 ``[N]``: the head ``b·H + h`` of every entry."""
        return segment_ids(self.count, self.num_entries)  # the total from a shape: no host read


def as_part_layout(part) -> PartLayout:
    """The general :class:`PartLayout` of a uniform part (:class:`kv_hex.uniform.UniformPart`; its per-entry maps
    materialised): what the reference path attends, and the definition the uniform kernel is tested against."""
    B, H, n = part.B, part.H, part.n
    S, N = B * H, part.num_entries
    device = part.before.device
    e = torch.arange(N, device=device)
    full = ((part.flags[e // 8] >> (e % 8).to(torch.uint8)) & 1).bool()
    cf = part.before[0].long()
    idx = torch.where(full, -1 - cf, e - cf).to(torch.int32)
    s, t = e // n, e % n
    code_row = torch.where(full, 0, e - cf)
    vgrp = (s // H) * n + t if part.value_layer else code_row
    ooff = part.before[1] if part.hcols.shape[-1] else torch.zeros(N, dtype=torch.int32, device=device)
    k = SideLayout(
        idx, part.k_codes, part.k_rows, part.k_scale, part.k_zero, s.to(torch.int32), part.k_over, ooff, True
    )
    v = SideLayout(
        idx, part.v_codes, part.v_rows, part.v_scale, part.v_zero, vgrp.to(torch.int32), part.v_over, ooff, False
    )
    start = torch.arange(S, device=device, dtype=torch.int32) * n
    count = torch.full((S,), n, dtype=torch.int32, device=device)
    return PartLayout(B, H, part.D, part.bits, start, count, n, t.to(torch.int32), part.hcols, k, v)
