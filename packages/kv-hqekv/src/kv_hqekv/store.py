"""The HqeKV cache of one layer: fp16, 4-bit, 2-bit and 1-bit tiers for keys and values, with real eviction."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kv_hqekv.capped_plan import CappedPlan
from kv_hqekv.kernels import (
    BlockedSide,
    BlockLayout,
    TierCodes,
    TieredSide,
    blocked_layout,
    dequantize_side_ref,
    transcode,
)
from kv_hqekv.quantizers import tier_quantizer
from kvcodec.ragged import Entries, QuantUnits, Residual, compact_entries
from kvcodec.segments import rank_in_segment
from kvcore import EVICT, FULL, KVView, Plan, Store, cap_plan, check_retier_plan, check_write_plan, reachable_bytes
from kvcore.checks import (
    check_append,
    check_batch_index,
    check_finite,
    check_int,
    check_kv,
    check_positions,
    values_checked,
)

QUANT_TIERS: tuple[int, ...] = (4, 2, 1)
"""The quantized tiers of HqeKV (§3.4): 4- and 2-bit uniform, 1-bit normalized."""

Parts = dict[str, tuple]  # kind -> (Residual (fp16), QuantUnits 4, QuantUnits 2, QuantUnits 1)


@dataclass(frozen=True)
class HeldSlots:
    """Where the held entries of one side (keys or values) sit in ``read()``, concatenated over the side's parts
    (fp16, 4-, 2- and 1-bit, in :meth:`HqeKVStore._held_tiers` order), each part's entries in the order of its
    ``positions()``.

    Parameters
    ----------
    seg, slot, pos : Tensor
        ``[N]`` int64: segment (``b·Hkv + h``), slot in ``read()`` (rank by position among the head's held keys) and
        true position of every entry.
    sizes : tuple[int, ...]
        Entries per part.
    """

    seg: torch.Tensor
    slot: torch.Tensor
    pos: torch.Tensor
    sizes: tuple[int, ...]

    def parts(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(seg, slot, pos)`` of each part (views)."""
        return list(zip(*(t.split(self.sizes) for t in (self.seg, self.slot, self.pos)), strict=True))

    def tiers(self, tiers: tuple[int, ...]) -> torch.Tensor:
        """``[N]`` uint8: the tier of each entry's part (``tiers`` per part)."""
        return torch.cat(
            [torch.full((n,), t, dtype=torch.uint8, device=self.seg.device) for n, t in zip(self.sizes, tiers)]
        )


def _cat(parts: list[Entries | None]) -> Entries:
    parts = [p for p in parts if p is not None]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


class HqeKVStore(Store):
    """One layer's HqeKV cache (Wang et al. 2025, "HqeKV", §3.3-3.5): packed per-tier segments for keys and values.

    Every held entry sits in exactly one part per side (keys, values): the fp16 rows (the fp16 blocks and the
    residual of fewer than ``T`` decode tokens, which ``append`` extends), or the packed codes of the 4-, 2- or
    1-bit tier, with its true position. Keys are quantized per channel in groups of ``block`` consecutive entries
    of a head (one block), values per token in groups of ``block`` channels (§3.4); the 4/2-bit tiers are uniform
    min-max (:class:`kvcodec.UniformQuantizer`), the 1-bit tier normalized
    (:class:`~kv_hqekv.normalized.NormalizedQuantizer`). Heads are ragged; evicted entries hold no memory and
    ``nbytes`` is every tensor reachable from the store (codes, group statistics, fp16 rows, positions, indices).

    Keys and values are tiered separately (HqeKV ranks them separately). The spec's choice (a) for a block whose
    key and value tiers disagree on eviction: an entry whose **key** is evicted is out of every softmax, so its
    value is unreachable and is not held either; an entry whose **value** is evicted while its key is kept stays in
    the softmax denominator with a zero value (``read()`` shows ``V = 0``; ``tiers()`` shows the value ``EVICT``).
    ``kv_hqekv.HqeKVSelector(joint_evict=True)`` evicts the same blocks for both.

    ``attend(query, scale)`` (``can_attend``) reads the packed codes of every tier without a dequantized copy of the
    cache (:func:`kv_hqekv.attention.mixed_tier_attention`: fused on CUDA, part by part on CPU); the HF adapter
    decodes through it.

    ``retier(plan)`` (``can_demote``): each entry is evicted, kept untouched (bit-identical bytes), or moved to a
    lower tier — a demotion reads only the demoted entries from their held codes or rows and quantizes them at the
    new tier with the block transcode kernel (:func:`kv_hqekv.kernels.transcode`; the authors' ``K_high_2_low``),
    never a dequantize-everything pass. Moving up is a ``ValueError``
    (§3.5, App. A.5: blocks only move down). Every mutation is all-or-nothing (parts are edited as copies and
    committed last, :mod:`kvcodec.ragged`).

    Parameters
    ----------
    block : int
        ``G``: key group length (tokens) and value group width (channels). Paper: 32.
    one_bit : {"normalized", "uniform"}
        The 1-bit tier's quantizer: HqeKV's normalized one (default) or uniform min-max (Table 6 "w/o II",
        :class:`~kv_hqekv.uniform_one_bit.UniformOneBitQuantizer`, held in the same form).
    """

    supported_bits = frozenset({EVICT, FULL, *QUANT_TIERS})
    can_demote = True
    can_attend = True

    def __init__(self, block: int = 32, one_bit: str = "normalized") -> None:
        self.block = check_int("block", block, low=1)
        self.one_bit = one_bit
        self.quantizers = {
            kind: {b: tier_quantizer(b, name, block, one_bit) for b in QUANT_TIERS}
            for kind, name in (("k", "key"), ("v", "value"))
        }
        self._edits = 0
        self.reset()

    def __repr__(self) -> str:
        extra = "" if self.one_bit == "normalized" else f", one_bit={self.one_bit!r}"
        return f"HqeKVStore(block={self.block}{extra})"

    # -- parts -----------------------------------------------------------------------------------------
    @staticmethod
    def _held_tiers() -> tuple[int, ...]:
        return (FULL, *QUANT_TIERS)

    def _unit(self, kind: str) -> int:
        return self.block if kind == "k" else 1

    def _empty_parts(self, B: int, H: int, D: int, dtype: torch.dtype, device: torch.device) -> Parts:
        empty = torch.zeros(B, H, 0, D, dtype=dtype, device=device)
        none = torch.zeros(B, H, 0, dtype=torch.bool, device=device)
        idx = torch.zeros(B, H, 0, dtype=torch.int32, device=device)
        return {
            kind: (
                Residual.from_mask(empty, none, idx),
                *(QuantUnits(self.quantizers[kind][b], self._unit(kind)) for b in QUANT_TIERS),
            )
            for kind in ("k", "v")
        }

    def _staged(self) -> Parts:
        return {kind: tuple(part.copy() for part in parts) for kind, parts in self._parts.items()}

    def _commit(self, parts: Parts, shape=None, last: torch.Tensor | None = None) -> None:
        """Make ``parts`` the content; ``last [B]`` (each batch row's last position) is recomputed unless given."""
        B, H, D = self._shape if shape is None else shape
        self._edits += 1  # a CappedPlan taken before this edit no longer applies (cap)
        self._max_len = None  # recomputed when asked (held_max_length)
        self._blocks = None  # the decode layout is taken again when asked (decode_layout)
        if last is not None:
            self._parts, self._shape, self._last_pos = parts, (B, H, D), last
            return
        held = [part.positions() for part in parts["k"]]
        device = parts["k"][0].length.device
        row = torch.cat([seg.to(device) for seg, _ in held]).long() // H
        pos = torch.cat([p.to(device) for _, p in held]).long()
        last = torch.full((B,), -1, dtype=torch.long, device=device).scatter_reduce(0, row, pos, reduce="amax")
        self._parts, self._shape, self._last_pos = parts, (B, H, D), last

    @property
    def _segments(self) -> int:
        B, H, _ = self._shape
        return B * H

    def _slots(self, kind: str, parts: Parts | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(seg, slot in read())`` of every entry of each part of ``kind``; slots follow the key entries."""
        return [(seg, slot) for seg, slot, _ in self._all_slots(parts, kinds=(kind,))[kind].parts()]

    def _all_slots(self, parts: Parts | None = None, kinds: tuple[str, ...] = ("k", "v")) -> dict[str, HeldSlots]:
        """The :class:`HeldSlots` of each side in ``kinds``, sorting the key entries once for all of them."""
        parts = self._parts if parts is None else parts
        S = self._segments
        kheld = [part.positions() for part in parts["k"]]
        kseg = torch.cat([sg.long() for sg, _ in kheld])
        kpos = torch.cat([p.long() for _, p in kheld])
        key = (kseg << 32) | kpos
        order = torch.argsort(key)
        sorted_key = key[order]
        slot_sorted, _ = rank_in_segment(kseg[order], S)
        out = {}
        for kind in kinds:
            if kind == "k":  # each key entry's own rank in the sort
                slot = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
                out[kind] = HeldSlots(kseg, slot, kpos, tuple(sg.numel() for sg, _ in kheld))
                continue
            held = [part.positions() for part in parts["v"]]  # a held value's key is held: one search finds it
            seg = torch.cat([sg.long() for sg, _ in held])
            pos = torch.cat([p.long() for _, p in held])
            q = (seg << 32) | pos
            idx = torch.searchsorted(sorted_key, q).clamp_max(max(sorted_key.numel() - 1, 0))
            slot = slot_sorted[idx] if q.numel() else q
            out[kind] = HeldSlots(seg, slot, pos, tuple(sg.numel() for sg, _ in held))
        return out

    # -- checks ----------------------------------------------------------------------------------------
    def _check_kv(self, keys: torch.Tensor, values: torch.Tensor, *, held: bool) -> None:
        check_kv(keys, values, held=(*self._shape, self._dtype) if held and self._shape is not None else None)

    # -- protocol --------------------------------------------------------------------------------------
    def write(self, keys: torch.Tensor, values: torch.Tensor, plan: Plan, positions: torch.Tensor) -> None:
        """Replace the content with ``keys``/``values [B, H, T, D]`` laid out per ``plan`` (tiers 0, 1, 2, 4, 16).

        Entries of a tier are quantized in groups of consecutive entries of that tier in a head (keys: ``block``
        entries per group, one block for HqeKV plans). All-or-nothing."""
        self._check_kv(keys, values, held=False)
        B, H, T, D = keys.shape
        kb, vb = check_write_plan(plan, (B, H, T), keys.device, "HqeKVStore", key_tiers=self.supported_bits)
        keep = kb != EVICT
        vb = torch.where(keep, vb, EVICT)  # a value whose key is evicted is unreachable (class doc)
        positions = check_positions("positions", positions, (B, T), keep=keep).to(keys.device)
        check_finite("keys (kept entries)", keys[keep])
        check_finite("values (kept entries)", values[vb != EVICT])
        parts = self._empty_parts(B, H, D, keys.dtype, keys.device)
        pos = positions[:, None, :].expand(B, H, T).int()
        for kind, x, bits in (("k", keys, kb), ("v", values, vb)):
            fp16 = Residual.from_mask(x, bits == FULL, pos)
            quant = []
            for b, units in zip(QUANT_TIERS, parts[kind][1:]):
                entries, _ = compact_entries(x, bits == b, pos)
                units.add(*QuantUnits.gather_units(entries, B * H, units.unit))
                quant.append(units)
            parts[kind] = (fp16, *quant)
        self.reset()
        self._dtype = keys.dtype
        self._commit(parts, (B, H, D))

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add ``[B, H, n, D]`` decode entries to the fp16 residual (§3.5: quantized when the next re-plan tiers
        them, :func:`kv_hqekv.decoding.requantize`). All-or-nothing."""
        self._check_kv(keys, values, held=True)
        B, H, n, D = keys.shape
        last = None if self._shape is None else self._last_pos
        positions = check_append(keys, values, positions, last)
        parts = self._empty_parts(B, H, D, keys.dtype, keys.device) if self._shape is None else self._staged()
        S = B * H
        pos = positions[:, None, :].expand(B, H, n).reshape(S, n)
        if values_checked(keys):  # host reads are cheap here: learn (once per edit) whether pushes can concatenate
            parts["k"][0].uniform_count(), parts["v"][0].uniform_count()
        parts["k"][0].push(keys.reshape(S, n, D), pos)
        parts["v"][0].push(values.reshape(S, n, D), pos)
        self._dtype = keys.dtype
        new_last = positions.long().amax(1)  # every new position is past the held ones (checked above)
        longest, blocks = self._max_len, self._blocks
        self._commit(parts, (B, H, D), new_last if last is None else torch.maximum(last, new_last))
        if longest is not None:  # every head gained n entries
            self._max_len = longest + n
        if blocks:  # a block layout stays valid through appends (kv_hqekv.kernels.blocked)
            layout, keys, values = blocks
            self._blocks = (layout.after_append(n), keys, values)
        elif blocks is False:
            self._blocks = False

    def read(self, query: torch.Tensor | None = None) -> KVView:
        """Dequantized, position-ordered view of the key-kept entries (value 0 where only the value is evicted);
        heads padded with ``-inf`` bias and position ``-1``."""
        if self._shape is None:
            raise ValueError("read() on an empty store: write() or append() first")
        B, H, D = self._shape
        S = B * H
        krows, kseg, kpos = _cat([p.entries() for p in self._parts["k"]])
        perm = torch.argsort((kseg.long() << 32) | kpos.long())
        krows, kseg, kpos = krows[perm], kseg[perm], kpos[perm]
        slot, counts = rank_in_segment(kseg, S)
        T = int(counts.max()) if counts.numel() else 0
        device = krows.device
        k = torch.zeros(S, T, D, dtype=self._dtype, device=device)
        v = torch.zeros(S, T, D, dtype=self._dtype, device=device)
        positions = torch.full((S, T), -1, dtype=torch.long, device=device)
        k[kseg, slot], positions[kseg, slot] = krows, kpos.long()
        for part, (vseg, vslot) in zip(self._parts["v"], self._slots("v")):
            e = part.entries()
            if e is not None and vseg.numel():
                v[vseg, vslot] = e[0].to(self._dtype)
        bias = torch.zeros(S, T, device=device).masked_fill(positions < 0, float("-inf"))
        return KVView(k.view(B, H, T, D), v.view(B, H, T, D), positions.view(B, H, T), bias.view(B, H, T))

    def tiers(self) -> Plan:
        """The tier of every held entry (keys and values), laid out like :meth:`read`."""
        if self._shape is None:
            raise ValueError("tiers() on an empty store: write() or append() first")
        return self._tiers_at(self._all_slots())

    def _tiers_at(self, slots: dict[str, HeldSlots]) -> Plan:
        """:meth:`tiers` from the entries' slots (:meth:`_all_slots`)."""
        B, H, _ = self._shape
        S = self._segments
        T = self.held_max_length()
        device = self._parts["k"][0].length.device
        out = []
        for kind in ("k", "v"):
            bits = torch.zeros(S, T, dtype=torch.uint8, device=device)
            for (seg, slot, _), tier in zip(slots[kind].parts(), self._held_tiers()):
                bits[seg, slot] = tier
            out.append(bits.view(B, H, T))
        return Plan(out[0], None if torch.equal(out[0], out[1]) else out[1])

    def retier(self, plan: Plan) -> None:
        """Evict, keep or demote every held entry per ``plan`` (laid out like :meth:`read`; class doc)."""
        if self._shape is None:
            raise ValueError("retier() on an empty store: write() or append() first")
        memo = plan.memo if isinstance(plan, CappedPlan) else []
        if len(memo) == 4 and memo[0]() is self and memo[1] == self._edits:  # capped here, nothing edited since
            slots, held = memo[2], memo[3]
        else:
            slots = self._all_slots()
            held = self._tiers_at(slots)
        memo.clear()
        kb, vb = check_retier_plan(plan, held, "HqeKVStore", eviction_only=False)
        sides = (("key_bits", kb, held.key_bits), ("value_bits", vb, held.bits_for_values))
        # tiers the store does not hold; entries moved up (the held tiers 0 < 1 < 2 < 4 < 16 are in numeric order)
        flags = [((new == 3) | ((new > 4) & (new != FULL)), (new != EVICT) & (new > old)) for _, new, old in sides]
        if any(torch.stack([f.any() for pair in flags for f in pair]).tolist()):  # one host read; details if bad
            for (name, new, _), (unsupported, up) in zip(sides, flags):
                if bool(unsupported.any()):
                    raise ValueError(
                        f"plan.{name} uses tiers {sorted(set(new[unsupported].tolist()))}; HqeKVStore holds "
                        f"{sorted(self.supported_bits)}"
                    )
                if bool(up.any()):
                    raise ValueError(
                        f"plan.{name} moves {int(up.sum())} held entries up a tier; HqeKV blocks only move down "
                        "(tier := min(held, planned), §3.5)"
                    )
        vb = torch.where(kb != EVICT, vb, EVICT)
        new_bits = {"k": kb.flatten(0, 1), "v": vb.flatten(0, 1)}  # [S, T]
        parts = self._staged()
        tiers = self._held_tiers()
        for kind in ("k", "v"):
            held_parts = self._parts[kind]  # what the demoted entries are transcoded from (never edited)
            staged = list(parts[kind])
            at = slots[kind]
            target = new_bits[kind][at.seg, at.slot]  # [N] every held entry's planned tier
            tier = at.tiers(tiers)
            down = (target != tier) & (target != EVICT)
            for part, stay in zip(staged, (target == tier).split(at.sizes)):
                part.keep(stay)  # staged parts are copies (all-or-nothing)
            row = down.nonzero().flatten()  # one host read for the side
            if row.numel():
                device = row.device
                local = torch.cat([torch.arange(n, device=device) for n in at.sizes])  # row in its part
                group = torch.cat(  # quantization group of the row in its part (0 for the fp16 rows)
                    [torch.zeros(at.sizes[0], dtype=torch.long, device=device)]
                    + [u.row_unit() if n else local[:0] for u, n in zip(held_parts[1:], at.sizes[1:])]
                )
                ref = torch.stack([tier[row].long(), local[row], group[row], at.seg[row], at.pos[row]], 1)
                dest = target[row]
                order = torch.argsort(dest, stable=True)  # refs by destination tier: 1, 2, 4
                per_tier = torch.bincount(dest.long(), minlength=max(QUANT_TIERS) + 1).tolist()  # one host read
                counts = [per_tier[b] for b in sorted(QUANT_TIERS)]
                for b, moved in zip(sorted(QUANT_TIERS), ref[order].split(counts)):
                    if moved.shape[0]:
                        units = staged[1 + QUANT_TIERS.index(b)]
                        units.add_quantized(*self._transcode(kind, held_parts, moved, b), real_rows=moved.shape[0])
            parts[kind] = tuple(staged)
        self._commit(parts)

    def cap(
        self, key_bits: torch.Tensor, value_bits: torch.Tensor, valid: torch.Tensor, slots: dict | None = None
    ) -> CappedPlan:
        """``kvcore.cap_plan`` against this store's tiers (``min(held, planned)``, ``EVICT`` where not ``valid``), as a
        :class:`CappedPlan` that spares the next :meth:`retier` finding the entries' slots and tiers again; ``slots``:
        :meth:`_all_slots` when the caller already found them."""
        slots = self._all_slots() if slots is None else slots
        held = self._tiers_at(slots)
        plan = cap_plan(self, key_bits, value_bits, valid, held=held)
        return CappedPlan.of(plan, [weakref.ref(self), self._edits, slots, held])

    def _transcode(self, kind: str, held: tuple, ref: torch.Tensor, bits: int) -> tuple:
        """Entries ``ref [N, 5]`` (held tier, row in its part, group, segment, position) of side ``kind`` quantized
        at ``bits`` from their held representation, in units of the side's unit (consecutive entries of a
        segment): ``(QuantizedTensor [Nu, U, D], seg [Nu], pos [Nu, U])`` for :meth:`QuantUnits.add_quantized`.

        The block transcode kernel (:func:`kv_hqekv.kernels.transcode`: Triton on CUDA, dequantize-then-quantize
        on CPU) reads the demoted entries straight from their held codes or fp16 rows; the uniform 1-bit ablation
        (``one_bit="uniform"``), which the kernel does not implement, goes through its quantizer."""
        S = self._segments
        ref = ref[torch.argsort((ref[:, 3] << 32) | ref[:, 4])]
        index, seg, pos = QuantUnits.gather_units((ref[:, :3], ref[:, 3], ref[:, 4].int()), S, self._unit(kind))
        _, *quant = held
        tables = {b: TierCodes.of(units, b) for b, units in zip(QUANT_TIERS, quant) if not units.empty}
        tier, row, group = index.unbind(-1)
        axis = "channel" if kind == "k" else "token"
        side = TieredSide(self._full_rows(kind), tables, tier.to(torch.uint8), row.int(), group.int(), axis, self.block)
        if bits == 1 and self.one_bit != "normalized":
            return self.quantizers[kind][bits].quantize(dequantize_side_ref(side)), seg, pos
        return transcode(side, bits, axis, self.block), seg, pos

    def attend(self, query: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query [B, Hq, Q, D]`` over the held cache read from the packed codes
        (:func:`kv_hqekv.attention.mixed_tier_attention`); equals ``kvcore.reference_attention(self.read(), ...)``."""
        if self._shape is None:
            raise ValueError("attend() on an empty store: write() or append() first")
        from kv_hqekv.attention import mixed_tier_attention

        return mixed_tier_attention(self, query, scale)

    def _full_rows(self, kind: str) -> torch.Tensor:
        """``[F, D]`` the full-precision rows of side ``kind`` (``"k"`` or ``"v"``) in the cache dtype."""
        rows = self._parts[kind][0].rows
        return rows if rows.dtype == self._dtype else rows.to(self._dtype)

    def decode_layout(self) -> tuple[BlockLayout, BlockedSide, BlockedSide] | None:
        """The held cache addressed by blocks (:mod:`kv_hqekv.kernels.blocked`), or ``None`` where its entries are
        not laid out in whole blocks (the per-entry maps then apply).

        Taken from the per-entry maps once after a write, re-tier, crop or reorder (one host read) and kept through
        appends, which only advance it: a decode step between re-plans builds no map. The full-precision parts
        learn at the same time whether every head holds as many rows
        (:meth:`kvcodec.ragged.Residual.uniform_count`). What is kept is small (per block and side: a tier, a first
        row and, for keys, a parameter row; per head: four ints) and is counted by :meth:`nbytes`; the sides are
        returned over the current full-precision rows."""
        if self._shape is None:
            return None
        if self._blocks is None:
            from kv_hqekv.attention import tiered_sides

            keys, values = tiered_sides(self)
            found = blocked_layout(keys, values, self._parts["k"][0].counts, self._parts["v"][0].counts, self.block)
            for kind in ("k", "v"):  # appends by concatenation where every head holds as many full rows
                self._parts[kind][0].uniform_count()
            if found is None:
                self._blocks = False
            else:  # held without the full rows, which every append replaces
                layout, bk, bv = found
                none = torch.empty(0, bk.head_dim, dtype=bk.dtype, device=bk.full.device)
                self._blocks = (layout, bk.with_full(none), bv.with_full(none))
        if self._blocks is False:
            return None
        layout, bk, bv = self._blocks
        return layout, bk.with_full(self._full_rows("k")), bv.with_full(self._full_rows("v"))

    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes of every tensor this store holds (codes, statistics, fp16 rows, positions, indices)."""
        return reachable_bytes(self, device)

    def held_max_length(self) -> int:
        """Entries held by the longest head (0 when empty): read from the device once after a write, re-tier, crop
        or reorder, then kept on the host through appends (every head gains the appended entries)."""
        if self._shape is None:
            return 0
        if self._max_len is None:
            self._max_len = int(self.seq_lengths().max()) if self._segments else 0
        return self._max_len

    def seq_lengths(self) -> torch.Tensor:
        """``[B, H]`` entries held per head (the key-kept entries)."""
        if self._shape is None:
            return torch.zeros(0, 0, dtype=torch.long)
        B, H, _ = self._shape
        device = self._parts["k"][0].length.device
        total = self._parts["k"][0].counts.clone()
        for units in self._parts["k"][1:]:
            total = total + units.counts(B * H, device)
        return total.view(B, H)

    def tier_counts(self) -> dict[str, torch.Tensor]:
        """``[B, H]`` entries per tier and side: ``keys_16``, ``keys_4``, ``keys_2``, ``keys_1`` and ``values_*``."""
        if self._shape is None:
            return {}
        B, H, _ = self._shape
        device = self._parts["k"][0].length.device
        out = {}
        for kind, name in (("k", "keys"), ("v", "values")):
            fp16, *quant = self._parts[kind]
            out[f"{name}_16"] = fp16.counts.view(B, H).clone()
            for b, units in zip(QUANT_TIERS, quant):
                out[f"{name}_{b}"] = units.counts(B * H, device).view(B, H)
        return out

    def crop(self, position: int) -> None:
        """Drop every entry whose true position is ``>= position`` (groups keep their statistics)."""
        check_int("position", position)
        if self._shape is None:
            return
        parts = self._staged()
        for staged in parts.values():
            for part in staged:
                part.crop(position)
        self._commit(parts)

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` of the batch becomes old row ``index[i]`` (beam search; rows may repeat or vanish)."""
        if self._shape is None:
            return
        B, H, D = self._shape
        device = self._parts["k"][0].length.device
        take = (check_batch_index("index", index, B).to(device)[:, None] * H + torch.arange(H, device=device)).flatten()
        parts = self._staged()
        for staged in parts.values():
            for part in staged:
                part.take_segments(take, B * H)
        self._commit(parts, (index.numel(), H, D))

    def reset(self) -> None:
        """Drop everything and free the memory."""
        self._shape: tuple[int, int, int] | None = None
        self._dtype: torch.dtype | None = None
        self._last_pos: torch.Tensor | None = None
        self._parts: Parts = {}
        self._max_len: int | None = None  # held_max_length(), when known
        self._blocks: tuple | bool | None = None  # decode_layout(): None not taken, False none since the last edit
        self._edits += 1  # edits so far (CappedPlan)
