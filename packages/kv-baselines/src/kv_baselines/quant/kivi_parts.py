"""The three kinds of storage a KIVI-style store holds per tensor (keys or values), over ragged segments.

* :class:`FullRows` -- entries kept in full precision for good (plan tier ``FULL`` outside the residual).
* :class:`Residual` -- KIVI's full-precision residual buffer, one dense row of slots per segment.
* :class:`QuantUnits` -- quantized entries, in *units* of ``U`` consecutive entries of one segment: one
  quantization group of ``G`` tokens for per-channel quantizers (KIVI keys), one token for per-token
  quantizers (KIVI values). Units are quantized once and never re-quantized (anchors.md §3: HF
  ``QuantizedLayer`` re-quantizes the whole cache when its residual fills).

Every entry carries its segment, true position and an insertion ``order`` (unique inside a segment), which
is how a read puts keys and values of different tiers back in the same order.
"""

from __future__ import annotations

import torch
from kvcore import QuantizedTensor, Quantizer

import kv_baselines.kernels.dispatch as _kernels
from kv_baselines.quant.segments import exclusive_cumsum, rank_in_segment, segment_take

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""``(rows [N, D], seg [N], pos [N], order [N])``."""


def compact_entries(x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, order: torch.Tensor) -> Entries:
    """Entries of ``x [B, H, T, D]`` where ``mask [B, H, T]``, in (segment, T) order (``pos``/``order`` ``[B, H, T]``)."""
    rows, lengths = _kernels.compact(x, mask)
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths.flatten())
    return rows, seg.int(), pos[mask].int(), order[mask].int()


class FullRows:
    """Flat full-precision entries ``[N, D]`` with their segment, position and order (int32)."""

    def __init__(self, rows: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, order: torch.Tensor) -> None:
        self.rows, self.seg, self.pos, self.order = rows, seg.int(), pos.int(), order.int()

    @classmethod
    def from_mask(cls, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, order: torch.Tensor) -> "FullRows":
        """Entries of ``x [B, H, T, D]`` where ``mask [B, H, T]``; ``pos``, ``order`` ``[B, H, T]``."""
        return cls(*compact_entries(x, mask, pos, order))

    def entries(self) -> Entries:
        return self.rows, self.seg, self.pos, self.order

    def counts(self, num_segments: int) -> torch.Tensor:
        return torch.bincount(self.seg.long(), minlength=num_segments)

    def crop(self, position: int) -> None:
        keep = self.pos < position
        self.rows, self.seg, self.pos, self.order = self.rows[keep], self.seg[keep], self.pos[keep], self.order[keep]

    def take_segments(self, take: torch.Tensor, num_segments: int) -> None:
        idx, new_seg = segment_take(self.seg, take, num_segments)
        self.rows, self.pos, self.order = self.rows[idx], self.pos[idx], self.order[idx]
        self.seg = new_seg.int()


class Residual:
    """Full-precision residual: ``data [S, cap, D]`` with ``length [S]`` valid slots per segment, oldest first."""

    def __init__(self, data: torch.Tensor, pos: torch.Tensor, order: torch.Tensor, length: torch.Tensor) -> None:
        self.data, self.pos, self.order, self.length = data, pos.int(), order.int(), length.long()

    @classmethod
    def from_mask(cls, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, order: torch.Tensor) -> "Residual":
        """Entries of ``x [B, H, T, D]`` where ``mask [B, H, T]``, in ``T`` order per segment."""
        B, H, T, D = x.shape
        S = B * H
        rows, seg, epos, eorder = compact_entries(x, mask, pos, order)
        slot, length = rank_in_segment(seg, S)
        cap = int(length.max()) if S else 0
        seg = seg.long()
        data = torch.zeros(S, cap, D, dtype=x.dtype, device=x.device)
        p = torch.zeros(S, cap, dtype=torch.int32, device=x.device)
        o = torch.zeros(S, cap, dtype=torch.int32, device=x.device)
        data[seg, slot], p[seg, slot], o[seg, slot] = rows, epos, eorder
        return cls(data, p, o, length)

    @property
    def capacity(self) -> int:
        return self.data.shape[1]

    def _valid(self) -> torch.Tensor:
        return torch.arange(self.capacity, device=self.data.device) < self.length[:, None]

    def entries(self) -> Entries:
        valid = self._valid()
        seg = torch.arange(self.data.shape[0], device=self.data.device)[:, None].expand_as(valid)
        return self.data[valid], seg[valid].int(), self.pos[valid], self.order[valid]

    def push(self, rows: torch.Tensor, pos: torch.Tensor, order: torch.Tensor) -> None:
        """Append ``rows [S, n, D]`` (with ``pos``/``order`` ``[S, n]``) after every segment's last entry."""
        S, n, D = rows.shape
        need = int(self.length.max()) + n if S else n
        if need > self.capacity:
            self._relayout(need)
        slot = self.length[:, None] + torch.arange(n, device=rows.device)
        seg = torch.arange(S, device=rows.device)[:, None].expand(S, n)
        self.data[seg, slot] = rows
        self.pos[seg, slot] = pos.int()
        self.order[seg, slot] = order.int()
        self.length = self.length + n

    def pop_front(self, k: torch.Tensor) -> Entries:
        """Remove the ``k[s]`` oldest entries of every segment; returns them in (segment, age) order."""
        S, cap, _ = self.data.shape
        ar = torch.arange(cap, device=self.data.device)
        taken = ar < k[:, None]
        seg = torch.arange(S, device=self.data.device)[:, None].expand(S, cap)
        out = (self.data[taken], seg[taken].int(), self.pos[taken], self.order[taken])
        src = (ar + k[:, None]).clamp_max(max(cap - 1, 0))
        self.data = torch.gather(self.data, 1, src[:, :, None].expand_as(self.data))
        self.pos = torch.gather(self.pos, 1, src)
        self.order = torch.gather(self.order, 1, src)
        self.length = self.length - k
        return out

    def crop(self, position: int) -> None:
        keep = self._valid() & (self.pos < position)
        rank = torch.cumsum(keep, 1) - 1
        S, cap, D = self.data.shape
        seg = torch.arange(S, device=self.data.device)[:, None].expand(S, cap)
        data, pos, order = torch.zeros_like(self.data), torch.zeros_like(self.pos), torch.zeros_like(self.order)
        data[seg[keep], rank[keep]] = self.data[keep]
        pos[seg[keep], rank[keep]] = self.pos[keep]
        order[seg[keep], rank[keep]] = self.order[keep]
        self.data, self.pos, self.order, self.length = data, pos, order, keep.sum(1)

    def take_segments(self, take: torch.Tensor, num_segments: int) -> None:
        take = take.long().to(self.data.device)
        self.data, self.pos, self.order, self.length = (
            self.data[take], self.pos[take], self.order[take], self.length[take]
        )

    def _relayout(self, cap: int) -> None:
        S, old, D = self.data.shape
        data = torch.zeros(S, cap, D, dtype=self.data.dtype, device=self.data.device)
        pos = torch.zeros(S, cap, dtype=torch.int32, device=self.data.device)
        order = torch.zeros(S, cap, dtype=torch.int32, device=self.data.device)
        data[:, :old], pos[:, :old], order[:, :old] = self.data, self.pos, self.order
        self.data, self.pos, self.order = data, pos, order


class QuantUnits:
    """Quantized entries in units of ``unit`` consecutive entries of one segment.

    Buffers hold ``capacity`` units (``codes [cap, U, PW]``, ``scales``/``zeros [cap, ...]``) of which the
    first ``n`` are in use; a unit's rows past its segment's entries (a partial last group) repeat the
    unit's last real row, so they do not change its min/max, and are marked invalid.

    Parameters
    ----------
    quantizer : kvcore.Quantizer
        Quantizes ``[units, U, D]`` tensors; with ``axis="channel"`` its ``group_size`` must equal ``unit``.
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
        self.order: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self._meta: tuple | None = None  # (bits, axis, group_size, D, dtype) of the stored QuantizedTensor

    # -- building ---------------------------------------------------------------------------------------
    @staticmethod
    def gather_units(
        rows: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, order: torch.Tensor, num_segments: int, unit: int
    ) -> tuple[torch.Tensor, ...]:
        """Cut entries sorted by (segment, order) into units of ``unit`` consecutive entries per segment.

        Returns ``x [Nu, U, D]``, ``seg [Nu]``, ``pos``, ``order``, ``valid`` ``[Nu, U]``.
        """
        device = rows.device
        counts = torch.bincount(seg.long(), minlength=num_segments)
        n_units = -(-counts // unit)
        unit_seg = torch.repeat_interleave(torch.arange(num_segments, device=device), n_units)
        local = torch.arange(int(n_units.sum()), device=device) - torch.repeat_interleave(exclusive_cumsum(n_units), n_units)
        i = local[:, None] * unit + torch.arange(unit, device=device)
        cnt = counts[unit_seg][:, None]
        valid = i < cnt
        src = exclusive_cumsum(counts)[unit_seg][:, None] + torch.minimum(i, cnt - 1)
        return rows[src], unit_seg.int(), pos[src].int(), order[src].int(), valid

    def add(self, x: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, order: torch.Tensor, valid: torch.Tensor) -> None:
        """Quantize ``x [Nu, U, D]`` (once) and append the units."""
        if x.shape[0] == 0:
            return
        q = self.quantizer.quantize(x)
        meta = (q.bits, q.axis, q.group_size, x.shape[-1], q.dtype)
        if self._meta is not None and meta != self._meta:
            raise ValueError(f"quantized units must share (bits, axis, group_size, D, dtype) {self._meta}, got {meta}")
        self._meta, self.codebook = meta, q.codebook
        new = {"codes": q.codes, "scales": q.scales, "zeros": q.zeros, "seg": seg.int(), "pos": pos.int(),
               "order": order.int(), "valid": valid}
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
        for name in ("codes", "scales", "zeros", "seg", "pos", "order", "valid"):
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
        valid = self.valid[:n]
        seg = self.seg[:n, None].expand(n, U)
        return x[valid], seg[valid], self.pos[:n][valid], self.order[:n][valid]

    def counts(self, num_segments: int, device: torch.device) -> torch.Tensor:
        if self.codes is None or self.n == 0:
            return torch.zeros(num_segments, dtype=torch.long, device=device)
        return torch.bincount(self.seg[: self.n].long(), weights=self.valid[: self.n].sum(1).double(),
                              minlength=num_segments).long()

    # -- editing ----------------------------------------------------------------------------------------
    def crop(self, position: int) -> None:
        """Invalidate entries at ``position`` or later; units left without entries are freed."""
        if self.codes is None:
            return
        self.valid[: self.n] &= self.pos[: self.n] < position
        keep = self.valid[: self.n].any(1).nonzero().flatten()
        self._resize(keep.numel(), keep)

    def take_segments(self, take: torch.Tensor, num_segments: int) -> None:
        if self.codes is None:
            return
        idx, new_seg = segment_take(self.seg[: self.n], take, num_segments)
        self._resize(idx.numel(), idx)
        self.seg[: self.n] = new_seg.int()
