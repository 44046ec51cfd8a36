"""The three kinds of storage a KIVI-style store holds per tensor (keys or values), over ragged segments.

* :class:`FullRows` -- entries kept in full precision for good (plan tier ``FULL`` outside the residual).
* :class:`Residual` -- KIVI's full-precision residual, ragged like :class:`FullRows`, with append / pop-oldest.
* :class:`QuantUnits` -- quantized entries, in *units* of ``U`` consecutive entries of one segment: one
  quantization group of ``G`` tokens for per-channel quantizers (KIVI keys), one token for per-token
  quantizers (KIVI values). Units are quantized once and never re-quantized (HF
  ``QuantizedLayer`` re-quantizes the whole cache when its residual fills); an evicted entry drops its packed
  code row while its unit keeps its scale and zero.

Every part can drop any subset of its entries (:meth:`keep`, in the order of ``positions()``) without touching
the others' bytes.

Edits never write into the rows a part already uses: they rebind its buffers to new tensors or (``QuantUnits``)
fill spare capacity past the rows in use. So :meth:`FullRows.copy` / :meth:`QuantUnits.copy` (shallow copies
sharing the buffers) are transactions: a store edits copies of its parts and keeps them only when every step
succeeded, and a failing step leaves the originals exactly as they were.

A *segment* is one (batch row, KV head). Every entry keeps its true position; positions are unique inside a
segment, so ``(segment, position)`` orders keys and values of different tiers identically on read. Metadata is
kept small because it is memory too (:mod:`kvcodec.narrow`): positions are stored as int16 while every position
fits (at most 32,767; widened to int32 for good the first time a larger one arrives); the positions of quantized
rows are run-length encoded as runs of consecutive positions (one start and one length per run: a quantization
unit covers consecutive tokens, so a unit costs one run instead of one position per row; the bytes they take depend
on how the positions are spaced, so rows evicted inside a unit can add a run where they free a code row); the
segment ids of quantization units run-length encoded (one id and one count per run of consecutive units of one
segment: a store appends units segment by segment, so runs are long), the per-unit row counts in int16, and the
full-precision rows carry per-segment counts only. Finding the narrowest dtype reads a value on the host, so where
the per-step value checks are off (accelerators by default, :func:`kvcore.checks.values_checked`) the metadata is
held in int32 instead (:func:`kvcodec.narrow.narrow_positions`) and runs joined by an append are left unmerged until
the part is next re-encoded: a few bytes more, no host sync. What the parts return (:meth:`FullRows.entries`,
:meth:`QuantUnits.positions`, ...) is int32 positions and int64 segment ids whatever is stored.
"""

from __future__ import annotations

import copy

import torch

import kvcodec.kernels.dispatch as _kernels
from kvcodec.narrow import narrow, narrow_int, narrow_positions
from kvcodec.segments import exclusive_cumsum, offsets_in_segment, segment_ids, segment_take
from kvcore import QuantizedTensor, Quantizer
from kvcore.checks import values_checked

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(rows [N, D], seg [N] int64, pos [N] int32)``, sorted by segment."""


def _runs(seg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run-length encoding ``(ids, lengths)`` of a segment-id vector, each int16 when it fits, else int32 (int32 or
    wider, unread, where the per-step value checks are off: :func:`kvcodec.narrow.narrow_positions`)."""
    if seg.numel() == 0:
        return seg.new_zeros(0, dtype=torch.int16), seg.new_zeros(0, dtype=torch.int16)
    ids, lengths = torch.unique_consecutive(seg.long(), return_counts=True)
    return narrow_positions(ids), narrow_positions(lengths)


def position_runs(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive positions ``(starts, lengths)`` of a position vector (a run continues while the next
    position is the previous one plus 1: ``pos[i] - i`` stays constant), each in the narrowest dtype
    (:func:`kvcodec.narrow.narrow`; int32 or wider, unread, where the per-step value checks are off:
    :func:`kvcodec.narrow.narrow_positions`); :func:`expand_runs` inverts it exactly."""
    if pos.numel() == 0:
        return pos.new_zeros(0, dtype=torch.int16), pos.new_zeros(0, dtype=torch.int16)
    shifted, lengths = torch.unique_consecutive(
        pos.long() - torch.arange(pos.numel(), device=pos.device), return_counts=True
    )
    return narrow_positions(shifted + exclusive_cumsum(lengths)), narrow_positions(lengths)


def expand_runs(starts: torch.Tensor, lengths: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """int32 positions of runs ``(starts, lengths)`` (the inverse of :func:`position_runs`; ``total`` =
    ``lengths.sum()`` when known, sparing a host read)."""
    lengths = lengths.long()
    run = segment_ids(lengths, total)
    return ((starts.long() - exclusive_cumsum(lengths))[run] + torch.arange(run.numel(), device=run.device)).int()


def _join_runs(
    values: torch.Tensor | None,
    lengths: torch.Tensor | None,
    new_values: torch.Tensor,
    new_lengths: torch.Tensor,
    continues,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run-length encodings ``(values, lengths)`` followed by ``(new_values, new_lengths)``, the first new run merged
    into the last old one when ``continues(last value, last length, first new value)``; narrow dtypes, never
    narrower than the old ones. Where the per-step value checks are off (accelerators by default,
    :func:`kvcore.checks.values_checked`) nothing is read on the host: the runs are not merged (one more run, which
    the next re-encoding of the part merges) and the dtypes are int32 or wider."""
    if values is None or values.numel() == 0:
        return new_values, new_lengths
    if not values_checked(new_values):
        return (
            narrow_positions(torch.cat([values.long(), new_values.long()]), values),
            narrow_positions(torch.cat([lengths.long(), new_lengths.long()]), lengths),
        )
    old_v, old_l, new_v, new_l = values.long(), lengths.long(), new_values.long(), new_lengths.long()
    if new_v.numel() and continues(int(old_v[-1]), int(old_l[-1]), int(new_v[0])):
        new_v, new_l = new_v.clone(), new_l.clone()
        new_v[0], new_l[0] = old_v[-1], new_l[0] + old_l[-1]
        old_v, old_l = old_v[:-1], old_l[:-1]
    return narrow(torch.cat([old_v, new_v]), values), narrow(torch.cat([old_l, new_l]), lengths)


def compact_entries(x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> tuple[Entries, torch.Tensor]:
    """Entries of ``x [B, H, T, D]`` where ``mask [B, H, T]``, in (segment, T) order, and the counts ``[B*H]``."""
    rows, lengths = _kernels.compact(x, mask)
    counts = lengths.flatten()
    seg = segment_ids(counts, rows.shape[0])
    return (rows, seg, pos[mask].int()), counts


class FullRows:
    """Flat full-precision entries ``rows [N, D]`` sorted by segment, with ``counts [S]`` and positions."""

    _even: int | None = None  # the count every segment holds, where known on the host (Residual.uniform_count)

    def __init__(self, rows: torch.Tensor, pos: torch.Tensor, counts: torch.Tensor) -> None:
        self.rows, self.pos, self.counts = rows, narrow(pos), counts.long()
        self._even = None

    @classmethod
    def from_mask(cls, x: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor) -> FullRows:
        """Entries of ``x [B, H, T, D]`` where ``mask [B, H, T]``; ``pos`` ``[B, H, T]``."""
        (rows, _, p), counts = compact_entries(x, mask, pos)
        return cls(rows, p, counts)

    def copy(self) -> FullRows:
        """A shallow copy sharing the buffers; editing it leaves this part unchanged (module doc)."""
        return copy.copy(self)

    def _seg(self) -> torch.Tensor:
        return segment_ids(self.counts, self.rows.shape[0])

    def entries(self) -> Entries:
        return self.rows, self._seg(), self.pos.int()

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seg, pos)`` of the entries, without touching the data."""
        return self._seg(), self.pos.int()

    def crop(self, position: int) -> None:
        keep = self.pos.int() < position  # never compare int16 with a Python int beyond its range
        seg = self._seg()
        self.counts = torch.bincount(seg[keep], minlength=self.counts.numel())
        self.rows, self.pos, self._even = self.rows[keep], self.pos[keep], None

    def take_segments(self, take: torch.Tensor, num_segments: int) -> None:
        idx, new_seg = segment_take(self._seg(), take, num_segments)
        self.rows, self.pos, self._even = self.rows[idx], self.pos[idx], None
        self.counts = torch.bincount(new_seg, minlength=take.numel())

    def keep(self, mask: torch.Tensor) -> None:
        """Keep the entries where ``mask`` (aligned with :meth:`positions`); the kept rows are copied unchanged."""
        seg = self._seg()
        self.counts = torch.bincount(seg[mask], minlength=self.counts.numel())
        self.rows, self.pos, self._even = self.rows[mask], self.pos[mask], None


class Residual(FullRows):
    """KIVI's full-precision residual: flat rows ``rows [N, D]`` sorted by segment, oldest first inside a segment,
    with ``counts [S]`` (alias ``length``) and positions -- the layout of :class:`FullRows`, so every entry costs its
    row and its position and nothing else (no per-segment padding: an evicted entry frees its bytes whichever
    segment it belongs to, and a residual holds exactly the bytes of the same entries written directly).

    The residual policies of a store are built from :meth:`push` (append after every segment's last entry) and
    :meth:`pop_front` (take the oldest entries of every segment, e.g. a full key block of ``R`` to quantize per
    channel, or the values leaving a FIFO of ``R``). Both rebuild the buffers at their exact new size in one gather
    (``O(N)``, with ``N <= S * R`` for KIVI's bounded residuals).
    """

    @property
    def length(self) -> torch.Tensor:
        """``[S]`` entries per segment (same as ``counts``)."""
        return self.counts

    def uniform_count(self) -> int | None:
        """The number of entries every segment holds, or ``None`` where segments differ: read on the host once
        (a sync on an accelerator), then known through :meth:`push` es until another edit. Where it is known,
        :meth:`push` appends by one concatenation per buffer instead of scattering every row."""
        if self._even is None and self.counts.numel():
            lo, hi = torch.stack(torch.aminmax(self.counts)).tolist()  # one host read
            if lo == hi:
                self._even = int(lo)
        return self._even

    def push(self, rows: torch.Tensor, pos: torch.Tensor) -> None:
        """Append ``rows [S, n, D]`` (positions ``[S, n]``) after every segment's last entry. Where
        :func:`kvcore.checks.values_checked` is off (accelerators by default) nothing is read on the host: the
        positions are then held in int32 (at least) instead of the narrowest dtype."""
        S, n, D = rows.shape
        if n == 0:
            return
        device = self.rows.device
        even = self._even
        if even is not None and self.counts.numel() == S:  # every segment holds `even`: [S, even + n] row blocks
            new_pos = narrow_positions(pos.reshape(S, n).to(device), self.pos, like=rows)
            old_rows, old_pos = self.rows.reshape(S, even, D), self.pos.reshape(S, even).to(new_pos.dtype)
            self.rows = torch.cat([old_rows, rows.to(device=device, dtype=self.rows.dtype)], 1).view(-1, D)
            self.pos = torch.cat([old_pos, new_pos], 1).view(-1)
            self.counts, self._even = self.counts + n, even + n
            return
        old = self.counts.to(device)
        new = old + n
        start = exclusive_cumsum(new)
        total = self.rows.shape[0] + S * n  # known on the host: no read of the counts
        seg = self._seg()
        dst_old = torch.arange(seg.numel(), device=device) + seg * n  # every earlier segment grew by n
        dst_new = (start + old)[:, None] + torch.arange(n, device=device)
        new_pos = narrow_positions(pos.reshape(S * n).to(device), self.pos, like=rows)
        data = torch.empty(total, D, dtype=self.rows.dtype, device=device)
        p = torch.empty(total, dtype=new_pos.dtype, device=device)
        data[dst_old], p[dst_old] = self.rows, self.pos.to(p.dtype)
        data[dst_new.flatten()] = rows.reshape(S * n, D).to(self.rows.dtype)
        p[dst_new.flatten()] = new_pos
        self.rows, self.pos, self.counts = data, p, new

    def pop_front(self, k: torch.Tensor) -> Entries:
        """Remove the ``k[s]`` oldest entries of every segment; returns them in (segment, age) order."""
        k = k.long().to(self.rows.device)
        seg = self._seg()
        taken = offsets_in_segment(self.counts, self.rows.shape[0]) < k[seg]
        out = (self.rows[taken], seg[taken], self.pos[taken].int())
        self.rows, self.pos, self.counts = self.rows[~taken], self.pos[~taken], self.counts - k
        self._even = None
        return out


class QuantUnits:
    """Quantized entries in units of ``unit`` consecutive entries of one segment, stored row by row.

    Unit-level buffers hold one quantization group each (``scales``/``zeros [capU, 1, C]`` and ``rows [capU]``
    int16, the number of code rows the unit still holds; the first ``nu`` in use) and the units' segment ids,
    run-length encoded (:attr:`seg` expands them); the row-level buffer holds one packed code row per *entry*
    (``codes [capR, PW]``, the first ``nr`` in use), sorted by unit, and the rows' positions are held as runs of
    consecutive positions (:func:`position_runs`; :attr:`pos` expands them). The group
    membership is explicit (``rows``; for ``U = 1`` rows and units correspond one to one and ``rows`` is not
    stored): dropping an entry drops its code row and leaves its unit's scale and zero as they
    were (never re-quantized; every row of a group shares them, so a row's slot is immaterial); a unit left
    without rows is freed. A unit's partial last group is quantized with its last real row repeated (the min/max
    are unchanged) and those padding rows are not stored.

    Parameters
    ----------
    quantizer : kvcore.Quantizer
        Quantizes ``[units, U, D]`` tensors; with ``axis="channel"`` its ``group_size`` equals ``unit``.
    unit : int
        Entries per unit ``U``.
    """

    _UNIT = ("scales", "zeros", "rows")
    _ROW = ("codes",)

    def __init__(self, quantizer: Quantizer, unit: int) -> None:
        self.quantizer = quantizer
        self.unit = unit
        self.nu = 0
        self.nr = 0
        self.codes: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.zeros: torch.Tensor | None = None
        self.codebook: torch.Tensor | None = None
        self._seg_ids: torch.Tensor | None = None  # run-length encoded segment id of every unit in use
        self._seg_lens: torch.Tensor | None = None
        self._pos_starts: torch.Tensor | None = None  # runs of consecutive positions of the rows in use
        self._pos_lens: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self._meta: tuple | None = None  # (bits, axis, group_size, D, dtype) of the stored QuantizedTensor

    def copy(self) -> QuantUnits:
        """A shallow copy sharing the buffers; editing it leaves this part unchanged (module doc)."""
        return copy.copy(self)

    @property
    def seg(self) -> torch.Tensor | None:
        """``[nu]`` int64 segment id of every unit in use (expanded from the run-length encoding)."""
        if self._seg_ids is None:
            return None
        return self._seg_ids.long()[segment_ids(self._seg_lens, self.nu)]

    @property
    def pos(self) -> torch.Tensor | None:
        """``[nr]`` int32 position of every row in use (expanded from the runs)."""
        if self._pos_starts is None:
            return None
        return expand_runs(self._pos_starts, self._pos_lens, self.nr)

    def _set_pos(self, pos: torch.Tensor) -> None:
        held = self._pos_starts
        self._pos_starts, self._pos_lens = position_runs(pos)
        self._pos_starts = narrow_positions(self._pos_starts, held)  # never narrower than what it already widened

    def _extend_pos(self, pos: torch.Tensor) -> None:
        starts, lens = position_runs(pos)
        self._pos_starts, self._pos_lens = _join_runs(
            self._pos_starts, self._pos_lens, starts, lens, lambda old, old_len, new: old + old_len == new
        )

    def _set_seg(self, seg: torch.Tensor) -> None:
        self._seg_ids, self._seg_lens = _runs(seg)

    def _extend_seg(self, seg: torch.Tensor) -> None:
        ids, lens = _runs(seg)
        self._seg_ids, self._seg_lens = _join_runs(
            self._seg_ids, self._seg_lens, ids, lens, lambda old, old_len, new: old == new
        )

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
        """Quantize ``x [Nu, U, D]`` (once) and append the units and their real rows (``pos >= 0``)."""
        if x.shape[0] == 0:
            return
        self.add_quantized(self.quantizer.quantize(x), seg, pos)

    def add_quantized(
        self, q: QuantizedTensor, seg: torch.Tensor, pos: torch.Tensor, real_rows: int | None = None
    ) -> None:
        """Append units already quantized, ``q`` of shape ``[Nu, U, D]`` (e.g. transcoded from held codes by a
        kernel; one group per unit, as this part's quantizer makes them), with their segments ``seg [Nu]`` and
        positions ``pos [Nu, U]`` (``-1`` on padding rows, which are not stored). ``real_rows``: the number of
        rows that are not padding, when the caller knows it (spares a host read)."""
        if q.shape[0] == 0:
            return
        meta = (q.bits, q.axis, q.group_size, q.shape[-1], q.dtype)
        if self._meta is not None and meta != self._meta:
            raise ValueError(f"quantized units must share (bits, axis, group_size, D, dtype) {self._meta}, got {meta}")
        if tuple(q.scales.shape[1:-1]) != (1,):
            raise ValueError(f"a unit must be one quantization group, got scales {tuple(q.scales.shape)}")
        U = self.unit
        real = pos >= 0
        count_dtype = narrow_int(U)
        units = {"scales": q.scales, "zeros": q.zeros, "rows": real.sum(1).to(count_dtype) if U > 1 else None}
        if real_rows is None:
            codes, real_pos = q.codes[real], pos[real]
        else:  # the real rows first, in order, by one stable sort: no read of their number
            take = torch.argsort((~real).flatten().to(torch.uint8), stable=True)[:real_rows]
            codes, real_pos = q.codes.flatten(0, 1)[take], pos.flatten()[take]
        self._meta, self.codebook = meta, q.codebook
        self.nu = self._append(self._UNIT, units, self.nu)
        self.nr = self._append(self._ROW, {"codes": codes}, self.nr)
        self._extend_seg(seg)
        self._extend_pos(real_pos)

    def _append(self, names: tuple[str, ...], new: dict[str, torch.Tensor | None], n: int) -> int:
        m = next(t for t in new.values() if t is not None).shape[0]
        for name in names:
            t, old = new[name], getattr(self, name)
            if t is None:
                continue
            if old is None:
                setattr(self, name, t.clone())
                continue
            if n + m > old.shape[0]:
                grown = torch.zeros(
                    (max(n + m, old.shape[0] + old.shape[0] // 2), *old.shape[1:]), dtype=old.dtype, device=old.device
                )
                grown[:n] = old[:n]
                setattr(self, name, grown)
                old = grown
            old[n : n + m] = t
        return n + m

    # -- reading ----------------------------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        return self.codes is None or self.nr == 0

    def row_unit(self) -> torch.Tensor:
        """``[nr]`` unit (group) index of every stored row."""
        if self.unit == 1:
            return torch.arange(self.nr, device=self.codes.device)
        return segment_ids(self.rows[: self.nu], self.nr)

    def dequantized(self) -> torch.Tensor:
        """``[nr, D]`` dequantized rows (through the quantizer, in its output dtype)."""
        bits, axis, group_size, D, dtype = self._meta
        nu, U = self.nu, self.unit
        cell = self.row_unit() * U
        if U != 1:
            cell = cell + offsets_in_segment(self.rows[: self.nu], self.nr)
        codes = torch.zeros(nu * U, self.codes.shape[-1], dtype=torch.uint8, device=self.codes.device)
        codes[cell] = self.codes[: self.nr]
        q = QuantizedTensor(
            codes=codes.view(nu, U, -1),
            scales=self.scales[:nu],
            zeros=None if self.zeros is None else self.zeros[:nu],
            bits=bits,
            axis=axis,
            group_size=group_size,
            shape=(nu, U, D),
            dtype=dtype,
            codebook=self.codebook,
        )
        return self.quantizer.dequantize(q).reshape(nu * U, D)[cell]

    def entries(self) -> Entries | None:
        if self.empty:
            return None
        return self.dequantized(), self.seg[self.row_unit()], self.pos

    def positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.empty:
            empty = torch.zeros(0, dtype=torch.long, device=self.codes.device if self.codes is not None else None)
            return empty, empty.int()
        return self.seg[self.row_unit()], self.pos

    def counts(self, num_segments: int, device: torch.device) -> torch.Tensor:
        if self.empty:
            return torch.zeros(num_segments, dtype=torch.long, device=device)
        return torch.bincount(self.seg[self.row_unit()], minlength=num_segments)

    # -- editing ----------------------------------------------------------------------------------------
    def keep(self, mask: torch.Tensor) -> None:
        """Keep the rows where ``mask`` (aligned with :meth:`positions`); units left without rows are freed.

        Kept rows and the scales/zeros of kept units are copied unchanged; buffers shrink to the kept size.
        """
        if self.codes is None:
            return
        row_idx = mask.nonzero().flatten()
        per_unit = torch.bincount(self.row_unit()[row_idx], minlength=self.nu)
        unit_idx = (per_unit > 0).nonzero().flatten()
        self._select(row_idx, unit_idx, per_unit[unit_idx])

    def _select(self, row_idx: torch.Tensor, unit_idx: torch.Tensor, rows_per_unit: torch.Tensor | None) -> None:
        """Rows ``row_idx`` and units ``unit_idx`` (old indices, rows grouped by unit in the new unit order)."""
        seg = self.seg[unit_idx]
        units = {n: None if getattr(self, n) is None else getattr(self, n)[unit_idx] for n in self._UNIT}
        units["rows"] = None if self.unit == 1 else rows_per_unit.to(self.rows.dtype)
        pos = self.pos[row_idx]
        for name, t in {**units, "codes": self.codes[row_idx]}.items():
            setattr(self, name, t)
        self.nu, self.nr = unit_idx.numel(), row_idx.numel()
        self._set_seg(seg)
        self._set_pos(pos)

    def crop(self, position: int) -> None:
        """Drop entries at ``position`` or later; units left without entries are freed."""
        if self.codes is None:
            return
        self.keep(self.pos < position)

    def take_segments(self, take: torch.Tensor, num_segments: int) -> None:
        if self.codes is None:
            return
        unit_idx, new_seg = segment_take(self.seg, take, num_segments)
        row_idx, _ = segment_take(self.row_unit(), unit_idx, self.nu)
        self._select(row_idx, unit_idx, None if self.unit == 1 else self.rows[unit_idx])
        self._set_seg(new_seg)
