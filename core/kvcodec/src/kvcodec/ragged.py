"""The three kinds of storage a KIVI-style store holds per tensor (keys or values), over ragged segments.

* :class:`FullRows` -- entries kept in full precision for good (plan tier ``FULL`` outside the residual).
* :class:`Residual` -- KIVI's full-precision residual buffer, one dense row of slots per segment.
* :class:`QuantUnits` -- quantized entries, in *units* of ``U`` consecutive entries of one segment: one
  quantization group of ``G`` tokens for per-channel quantizers (KIVI keys), one token for per-token
  quantizers (KIVI values). Units are quantized once and never re-quantized (HF
  ``QuantizedLayer`` re-quantizes the whole cache when its residual fills).

A *segment* is one (batch row, KV head). Every entry keeps its true position (int32); positions are unique
inside a segment, so ``(segment, position)`` orders keys and values of different tiers identically on read.
Metadata is kept small because it is memory too: 4 bytes of position per entry, a 4-byte segment id per
quantization unit, per-segment counts for the full-precision rows.
"""

from __future__ import annotations

import torch
from kvcore import QuantizedTensor, Quantizer

import kvcodec.kernels.dispatch as _kernels
from kvcodec.segments import exclusive_cumsum, rank_in_segment, segment_ids, segment_take

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(rows [N, D], seg [N] int64, pos [N] int32)``, sorted by segment."""


def compact_entries(x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> tuple[Entries, torch.Tensor]:
    """Entries of ``x [B, H, T, D]`` where ``mask [B, H, T]``, in (segment, T) order, and the counts ``[B*H]``."""
    rows, lengths = _kernels.compact(x, mask)
    counts = lengths.flatten()
    seg = segment_ids(counts)
    return (rows, seg, pos[mask].int()), counts


class FullRows:
    """Flat full-precision entries ``rows [N, D]`` sorted by segment, with ``counts [S]`` and positions."""

    def __init__(self, rows: torch.Tensor, pos: torch.Tensor, counts: torch.Tensor) -> None:
        self.rows, self.pos, self.counts = rows, pos.int(), counts.long()

    @classmethod
    def from_mask(cls, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> "FullRows":
        """Entries of ``x [B, H, T, D]`` where ``mask [B, H, T]``; ``pos`` ``[B, H, T]``."""
        (rows, _, p), counts = compact_entries(x, mask, pos)
        return cls(rows, p, counts)

    def _seg(self) -> torch.Tensor:
        return segment_ids(self.counts)

    def entries(self) -> Entries:
        return self.rows, self._seg(), self.pos

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seg, pos)`` of the entries, without touching the data."""
        return self._seg(), self.pos

    def crop(self, position: int) -> None:
        keep = self.pos < position
        seg = self._seg()
        self.counts = torch.bincount(seg[keep], minlength=self.counts.numel())
        self.rows, self.pos = self.rows[keep], self.pos[keep]

    def take_segments(self, take: torch.Tensor, num_segments: int) -> None:
        idx, new_seg = segment_take(self._seg(), take, num_segments)
        self.rows, self.pos = self.rows[idx], self.pos[idx]
        self.counts = torch.bincount(new_seg, minlength=take.numel())


class Residual:
    """Full-precision residual: ``data [S, cap, D]`` with ``length [S]`` valid slots per segment, oldest first."""

    def __init__(self, data: torch.Tensor, pos: torch.Tensor, length: torch.Tensor) -> None:
        self.data, self.pos, self.length = data, pos.int(), length.long()

    @classmethod
    def from_mask(cls, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> "Residual":
        """Entries of ``x [B, H, T, D]`` where ``mask [B, H, T]``, in ``T`` order per segment."""
        B, H, T, D = x.shape
        S = B * H
        (rows, seg, epos), length = compact_entries(x, mask, pos)
        slot, _ = rank_in_segment(seg, S)
        cap = int(length.max()) if S else 0
        data = torch.zeros(S, cap, D, dtype=x.dtype, device=x.device)
        p = torch.zeros(S, cap, dtype=torch.int32, device=x.device)
        data[seg, slot], p[seg, slot] = rows, epos
        return cls(data, p, length)

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    def _valid(self) -> torch.Tensor:
        return torch.arange(self.capacity, device=self.data.device) < self.length[:, None]

    def _seg_grid(self) -> torch.Tensor:
        S, cap = self.pos.shape
        return torch.arange(S, device=self.data.device)[:, None].expand(S, cap)

    def entries(self) -> Entries:
        valid = self._valid()
        return self.data[valid], self._seg_grid()[valid], self.pos[valid]

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        valid = self._valid()
        return self._seg_grid()[valid], self.pos[valid]

    def push(self, rows: torch.Tensor, pos: torch.Tensor) -> None:
        """Append ``rows [S, n, D]`` (positions ``[S, n]``) after every segment's last entry."""
        S, n, _ = rows.shape
        need = (int(self.length.max()) if S else 0) + n
        if need > self.capacity:
            data = torch.zeros(S, need, rows.shape[-1], dtype=self.data.dtype, device=self.data.device)
            p = torch.zeros(S, need, dtype=torch.int32, device=self.data.device)
            data[:, : self.capacity], p[:, : self.capacity] = self.data, self.pos
            self.data, self.pos = data, p
        slot = self.length[:, None] + torch.arange(n, device=rows.device)
        seg = torch.arange(S, device=rows.device)[:, None].expand(S, n)
        self.data[seg, slot] = rows
        self.pos[seg, slot] = pos.int()
        self.length = self.length + n

    def pop_front(self, k: torch.Tensor) -> Entries:
        """Remove the ``k[s]`` oldest entries of every segment; returns them in (segment, age) order."""
        S, cap, _ = self.data.shape
        ar = torch.arange(cap, device=self.data.device)
        taken = ar < k[:, None]
        out = (self.data[taken], self._seg_grid()[taken], self.pos[taken])
        src = (ar + k[:, None]).clamp_max(max(cap - 1, 0))
        self.data = torch.gather(self.data, 1, src[:, :, None].expand_as(self.data))
        self.pos = torch.gather(self.pos, 1, src)
        self.length = self.length - k
        return out

    def crop(self, position: int) -> None:
        keep = self._valid() & (self.pos < position)
        rank = torch.cumsum(keep, 1) - 1
        seg = self._seg_grid()
        data, pos = torch.zeros_like(self.data), torch.zeros_like(self.pos)
        data[seg[keep], rank[keep]] = self.data[keep]
        pos[seg[keep], rank[keep]] = self.pos[keep]
        self.data, self.pos, self.length = data, pos, keep.sum(1)

    def take_segments(self, take: torch.Tensor, num_segments: int) -> None:
        take = take.long().to(self.data.device)
        self.data, self.pos, self.length = self.data[take], self.pos[take], self.length[take]


class QuantUnits:
    """Quantized entries in units of ``unit`` consecutive entries of one segment.

    Buffers hold ``capacity`` units (``codes [cap, U, PW]``, ``scales``/``zeros [cap, ...]``, ``seg [cap]``,
    ``pos [cap, U]``) of which the first ``n`` are in use. A unit's rows past its segment's entries (a
    partial last group) repeat the unit's last real row, so they leave its min/max unchanged, and have
    position ``-1`` (not an entry).

    Parameters
    ----------
    quantizer : kvcore.Quantizer
        Quantizes ``[units, U, D]`` tensors; with ``axis="channel"`` its ``group_size`` equals ``unit``.
    unit : int
        Entries per unit ``U``.
    """

    def __init__(self, quantizer: Quantizer, unit: int) -> None:
        self.quantizer = quantizer
        self.unit = unit
        self.n = 0
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.zeros: torch.Tensor | None = None
        self.codebook: torch.Tensor | None = None
        self.seg: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self._meta: tuple | None = None  # (bits, axis, group_size, D, dtype) of the stored QuantizedTensor

    # -- building ---------------------------------------------------------------------------------------
    @staticmethod
    def gather_units(entries: Entries, num_segments: int, unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cut entries sorted by (segment, position) into units of ``unit`` consecutive entries per segment.

        Returns ``x [Nu, U, D]``, ``seg [Nu]`` and ``pos [Nu, U]`` (``-1`` on padding rows).
        """
        rows, seg, pos = entries
        device = rows.device
        counts = torch.bincount(seg.long(), minlength=num_segments)
        n_units = -(-counts // unit)
        unit_seg = segment_ids(n_units)
        local = torch.arange(unit_seg.numel(), device=device) - exclusive_cumsum(n_units)[unit_seg]
        i = local[:, None] * unit + torch.arange(unit, device=device)
        cnt = counts[unit_seg][:, None]
        src = exclusive_cumsum(counts)[unit_seg][:, None] + torch.minimum(i, cnt - 1)
        return rows[src], unit_seg, torch.where(i < cnt, pos[src], -1).int()

    def add(self, x: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor) -> None:
        """Quantize ``x [Nu, U, D]`` (once) and append the units."""
        if x.shape[0] == 0:
            return
        q = self.quantizer.quantize(x)
        meta = (q.bits, q.axis, q.group_size, x.shape[-1], q.dtype)
        if self._meta is not None and meta != self._meta:
            raise ValueError(f"quantized units must share (bits, axis, group_size, D, dtype) {self._meta}, got {meta}")
        self._meta, self.codebook = meta, q.codebook
        new = {"codes": q.codes, "scales": q.scales, "zeros": q.zeros, "seg": seg.int(), "pos": pos.int()}
        m = x.shape[0]
        if self.codes is None:
            for name, t in new.items():
                setattr(self, name, None if t is None else t.clone())
            self.n = m
            return
        if self.n + m > self.capacity:
            self._resize(max(self.n + m, self.capacity + self.capacity // 2))
        for name, t in new.items():
            if t is not None:
                getattr(self, name)[self.n: self.n + m] = t
        self.n += m

    @property
    def capacity(self) -> int:
        return 0 if self.codes is None else self.codes.shape[0]

    def _resize(self, cap: int, index: torch.Tensor | None = None) -> None:
        """Reallocate with ``cap`` units, keeping units ``index`` (default: the ``n`` in use) in front."""
        keep = torch.arange(self.n, device=self.codes.device) if index is None else index
        for name in ("codes", "scales", "zeros", "seg", "pos"):
            old = getattr(self, name)
            if old is None:
                continue
            new = torch.zeros((cap, *old.shape[1:]), dtype=old.dtype, device=old.device)
            new[: keep.numel()] = old[keep]
            setattr(self, name, new)
        self.n = keep.numel()

    # -- reading ----------------------------------------------------------------------------------------
    def entries(self) -> Entries | None:
        if self.codes is None or self.n == 0:
            return None
        bits, axis, group_size, D, dtype = self._meta
        n, U = self.n, self.unit
        q = QuantizedTensor(
            codes=self.codes[:n], scales=self.scales[:n], zeros=None if self.zeros is None else self.zeros[:n],
            bits=bits, axis=axis, group_size=group_size, shape=(n, U, D), dtype=dtype, codebook=self.codebook,
        )
        x = self.quantizer.dequantize(q)
        pos = self.pos[:n]
        valid = pos >= 0
        seg = self.seg[:n, None].long().expand(n, U)
        return x[valid], seg[valid], pos[valid]

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.codes is None or self.n == 0:
            empty = torch.zeros(0, dtype=torch.long, device=self.codes.device if self.codes is not None else None)
            return empty, empty.int()
        pos = self.pos[: self.n]
        seg = self.seg[: self.n, None].long().expand_as(pos)
        return seg[pos >= 0], pos[pos >= 0]

    def counts(self, num_segments: int, device: torch.device) -> torch.Tensor:
        if self.codes is None or self.n == 0:
            return torch.zeros(num_segments, dtype=torch.long, device=device)
        per_unit = (self.pos[: self.n] >= 0).sum(1)
        return torch.bincount(self.seg[: self.n].long(), weights=per_unit.double(), minlength=num_segments).long()

    # -- editing ----------------------------------------------------------------------------------------
    def crop(self, position: int) -> None:
        """Drop entries at ``position`` or later (their rows stay in a kept unit); empty units are freed."""
        if self.codes is None:
            return
        pos = self.pos[: self.n]
        pos.masked_fill_(pos >= position, -1)
        keep = (pos >= 0).any(1).nonzero().flatten()
        self._resize(keep.numel(), keep)

    def take_segments(self, take: torch.Tensor, num_segments: int) -> None:
        if self.codes is None:
            return
        idx, new_seg = segment_take(self.seg[: self.n], take, num_segments)
        self._resize(idx.numel(), idx)
        self.seg[: self.n] = new_seg.int()
