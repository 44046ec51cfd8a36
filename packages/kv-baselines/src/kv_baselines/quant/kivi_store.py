"""KIVI's quantized KV cache as a ``kvcore.Store``: per-channel keys, per-token values, full-precision residuals."""

from __future__ import annotations

import warnings

import torch

from kvcodec import CodeRows, QuantizedSegment, UniformQuantizer, quantized_attention
from kvcodec.ragged import Entries, FullRows, QuantUnits, Residual, compact_entries
from kvcodec.segments import rank_in_segment
from kvcore import EVICT, FULL, KVView, Plan, Quantizer, Store, reachable_bytes, reference_attention
from kvcore.attention import check_query, check_scale
from kvcore.checks import check_finite, check_float, check_int, check_integer_tensor, check_positions, check_tensor


def _cat(parts: list[Entries | None]) -> Entries:
    parts = [p for p in parts if p is not None]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]


class KIVIUnquantizedWarning(UserWarning):
    """A ``KIVIStore.write`` plan keeps more entries than the residual but quantizes none of them."""


class KIVIStore(Store):
    """One layer's KV cache quantized the KIVI way (Liu et al. 2024, "KIVI", §3.3-3.4).

    Keys are quantized per channel (groups of ``G`` consecutive tokens of one head), values per token, and
    each keeps a full-precision residual whose policy differs (KIVI ``models/llama_kivi.py``):

    * keys: the residual grows to ``residual`` tokens, then the whole block is quantized per channel in one
      go (so ``residual % G == 0``);
    * values: the residual is a FIFO of ``residual`` tokens; once it is exceeded the oldest token is
      quantized per token.

    Already quantized data is never re-quantized (HF ``QuantizedLayer`` re-quantizes the whole cache when
    its residual fills). Heads are ragged: evicted entries hold no memory. ``read`` returns each head's
    entries in position order, so the true positions of the kept entries of a batch row must be distinct
    (>= 0), and appended positions must come after every position held in their row.

    ``write`` follows the plan exactly: entries planned ``EVICT`` are dropped, entries planned at a
    quantizer's bits are quantized (groups of consecutive quantized entries of one head), entries planned
    ``FULL`` stay in full precision and read back bit-exact. Keys and values may have different tiers but
    must keep the same entries. The trailing ``FULL`` entries of a head (after its last quantized entry) are
    KIVI's residual and follow the residual policy on ``append``: the last ``m mod residual`` of such a run of
    ``m`` keys and the last ``min(m, residual)`` values; earlier ``FULL`` entries stay full precision for good.
    :class:`~kv_baselines.quant.KIVITierSelector` produces KIVI's own prefill layout (all ``FULL`` entries
    are then residual).

    Parameters
    ----------
    key_quantizer : kvcore.Quantizer
        Default ``UniformQuantizer(2, "channel", 32)`` (KIVI-2, ``example.py``).
    value_quantizer : kvcore.Quantizer
        Must group per token (``axis="token"``). Default ``UniformQuantizer(2, "token", 32)``.
    residual : int
        ``R``, full-precision residual length (KIVI's ``residual_length``; 128 in the paper's runs).

    Notes
    -----
    ``tiers()``/``retier(plan)`` (kvcore contract v2) evict any held entry: a dropped entry of a per-channel key
    group frees its packed code row while the group keeps its scale and zero (nothing is re-quantized), and every
    other entry's bytes are untouched; there is no demotion (``can_demote = False``). ``attend(query, scale)``
    runs :func:`kvcodec.quantized_attention` on the held codes and full-precision rows (the Triton kernel on CUDA)
    and equals ``kvcore.reference_attention(self.read(), query, scale)``.

    Every mutation (``write``, ``append``, ``retier``, ``crop``, ``reorder``) is all-or-nothing: arguments are
    validated first (finite entries, positions as :func:`kvcore.checks.check_positions`), then the new state is built
    on copies of the parts (:meth:`kvcodec.ragged.FullRows.copy`) and committed last, so a call that raises -- e.g.
    a residual flush whose group range overflows the quantizer's scale dtype -- leaves ``read()`` and ``nbytes()``
    unchanged.
    """

    can_attend = True
    can_demote = False

    def __init__(
        self,
        key_quantizer: Quantizer | None = None,
        value_quantizer: Quantizer | None = None,
        residual: int = 128,
    ) -> None:
        kq = UniformQuantizer(2, "channel", 32) if key_quantizer is None else key_quantizer
        vq = UniformQuantizer(2, "token", 32) if value_quantizer is None else value_quantizer
        for name, q in (("key_quantizer", kq), ("value_quantizer", vq)):
            if not isinstance(q, Quantizer):
                raise TypeError(f"{name} must implement kvcore.Quantizer, got {type(q).__name__}")
            if q.bits in (EVICT, FULL):
                raise ValueError(f"{name}.bits must be a quantized width, not {q.bits}")
        if vq.axis != "token":
            raise ValueError(f"value_quantizer must group per token (axis='token'), got axis={vq.axis!r}")
        if isinstance(residual, bool) or not isinstance(residual, int) or residual < 1:
            raise ValueError(f"residual must be an int >= 1, got {residual!r}")
        if kq.axis == "channel" and residual % kq.group_size:
            raise ValueError(
                f"residual ({residual}) must be a multiple of key_quantizer.group_size ({kq.group_size}): "
                "a full key residual is quantized per channel in whole groups"
            )
        self.key_quantizer = kq
        self.value_quantizer = vq
        self.residual = residual
        self.supported_bits = frozenset({EVICT, FULL, kq.bits, vq.bits})
        self.reset()

    # -- state -----------------------------------------------------------------------------------------
    def _slots(self, kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(seg, slot in read())`` of every entry of each part of ``kind``, in the part's ``positions()`` order."""
        S = self._segments
        held = [part.positions() for part in self._parts[kind]]
        seg = torch.cat([sg.long() for sg, _ in held])
        pos = torch.cat([p.long() for _, p in held])
        order = torch.argsort((seg << 32) | pos)
        slot_sorted, _ = rank_in_segment(seg[order], S)
        slot = torch.empty_like(slot_sorted)
        slot[order] = slot_sorted
        out, start = [], 0
        for sg, _ in held:
            n = sg.numel()
            out.append((seg[start : start + n], slot[start : start + n]))
            start += n
        return out

    def _held_tiers(self, kind: str) -> tuple[int, int, int]:
        q = self.key_quantizer if kind == "k" else self.value_quantizer
        return FULL, q.bits, FULL  # FullRows, QuantUnits, Residual

    def tiers(self) -> Plan:
        """The tier of every held entry (``FULL`` or the quantizer's bits), laid out like :meth:`read`."""
        if self._shape is None:
            raise ValueError("tiers() on an empty store: write() or append() first")
        B, H, _ = self._shape
        S = self._segments
        T = int(self.seq_lengths().max()) if S else 0
        device = self._parts["k"][2].length.device
        out = []
        for kind in ("k", "v"):
            bits = torch.zeros(S, T, dtype=torch.uint8, device=device)
            for (seg, slot), tier in zip(self._slots(kind), self._held_tiers(kind)):
                bits[seg, slot] = tier
            out.append(bits.view(B, H, T))
        return Plan(out[0], out[1])

    def retier(self, plan: Plan) -> None:
        """Evict the entries ``plan`` marks ``EVICT`` (laid out like :meth:`read`); every other entry keeps its tier
        and its bytes. Raises ``ValueError`` (changing nothing) for another tier, padding kept, or different kept
        sets for keys and values."""
        if self._shape is None:
            raise ValueError("retier() on an empty store: write() or append() first")
        held = self.tiers()
        if not isinstance(plan, Plan) or tuple(plan.key_bits.shape) != tuple(held.key_bits.shape):
            raise ValueError(f"plan must be a kvcore.Plan laid out like read(): shape {tuple(held.key_bits.shape)}")
        if plan.full_precision is not None:
            raise ValueError("KIVIStore does not hold element-level full-precision masks (plan.full_precision)")
        device = held.key_bits.device
        kb, vb = plan.key_bits.to(device), plan.bits_for_values.to(device)
        for name, new, old in (("key_bits", kb, held.key_bits), ("value_bits", vb, held.bits_for_values)):
            padding = old == EVICT
            if bool((padding & (new != EVICT)).any()):
                raise ValueError(f"plan.{name} keeps padding entries (positions -1 in read()); padding must be EVICT")
            changed = ~padding & (new != EVICT) & (new != old)
            if bool(changed.any()):
                raise ValueError(
                    f"plan.{name} moves held entries to another tier ({sorted(set(new[changed].tolist()))}); "
                    "KIVIStore re-tiers by eviction only (each entry EVICT or its held tier, see tiers())"
                )
        if not torch.equal(kb != EVICT, vb != EVICT):
            raise ValueError("plan must keep the same entries for keys and values in a KIVIStore (tiers may differ)")
        keep = (kb != EVICT).flatten(0, 1)  # [S, T]
        masks = {kind: [keep[seg, slot] for seg, slot in self._slots(kind)] for kind in ("k", "v")}
        parts = self._staged()
        for kind, staged in parts.items():
            for part, mask in zip(staged, masks[kind]):
                part.keep(mask)
        self._commit(parts)

    # -- transactions ----------------------------------------------------------------------------------
    def _staged(self) -> dict[str, tuple[FullRows, QuantUnits, Residual]]:
        """Copies of the parts to edit (the held ones are untouched until :meth:`_commit`)."""
        return {kind: tuple(part.copy() for part in parts) for kind, parts in self._parts.items()}

    def _commit(self, parts: dict[str, tuple[FullRows, QuantUnits, Residual]], shape=None) -> None:
        """Make the edited ``parts`` (and ``shape``) the held state: the last step of every mutation, reached only
        when everything before it succeeded, so a failing call leaves ``read()`` and ``nbytes()`` unchanged."""
        B, H, D = self._shape if shape is None else shape
        held = [part.positions() for part in parts["k"]]
        device = parts["k"][2].length.device
        row = torch.cat([seg.to(device) for seg, _ in held]).long() // H
        pos = torch.cat([p.to(device) for _, p in held]).long()
        last = torch.full((B,), -1, dtype=torch.long, device=device).scatter_reduce(0, row, pos, reduce="amax")
        self._parts, self._shape, self._last_pos = parts, (B, H, D), last

    # -- fused attention -------------------------------------------------------------------------------
    def _side(self, kind: str) -> tuple[CodeRows, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The held ``kind`` entries as code rows + full rows, with ``(seg, pos, row, group)`` per entry."""
        full, units, resid = self._parts[kind]
        q = units.quantizer
        if not isinstance(q, UniformQuantizer):
            return None
        D = self._shape[2]
        device = resid.length.device
        full_rows = torch.cat([full.rows, resid.rows])
        fseg, fpos = full.positions()
        rseg, rpos = resid.positions()
        full_row = torch.arange(full_rows.shape[0], device=device)
        if units.empty:
            pw, C = (D * q.bits + 7) // 8, D if q.axis == "channel" else -(-D // q.group_size)
            codes = torch.zeros(0, pw, dtype=torch.uint8, device=device)
            scales = zeros = torch.zeros(0, C, dtype=self._dtype, device=device)
            qseg = qpos = qrow = qgroup = torch.zeros(0, dtype=torch.long, device=device)
        else:
            codes = units.codes
            scales, zeros = units.scales.flatten(1), units.zeros.flatten(1)
            qseg, qpos = units.positions()
            qrow = torch.arange(units.nr, device=device)
            qgroup = units.row_unit()
        side = CodeRows(codes, scales, zeros, q.bits, q.axis, q.group_size, full_rows)
        seg = torch.cat([fseg.long(), rseg.long(), qseg.long()])
        pos = torch.cat([fpos.long(), rpos.long(), qpos.long()])
        row = torch.cat([-1 - full_row, qrow])
        group = torch.cat([torch.zeros_like(full_row), qgroup])
        return side, seg, pos, row, group

    def quantized_segment(self) -> QuantizedSegment | None:
        """The held cache as a :class:`kvcodec.QuantizedSegment` laid out like :meth:`read` (``None`` when a
        quantizer is not a ``kvcodec.UniformQuantizer``)."""
        B, H, _ = self._shape
        S = self._segments
        sides = [self._side("k"), self._side("v")]
        if sides[0] is None or sides[1] is None:
            return None
        T = int(self.seq_lengths().max()) if S else 0
        device = sides[0][1].device
        maps = []
        for side, seg, pos, row, group in sides:
            order = torch.argsort((seg << 32) | pos)
            seg, row, group = seg[order], row[order], group[order]
            slot, _ = rank_in_segment(seg, S)
            r = torch.zeros(S, T, dtype=torch.long, device=device)
            g = torch.zeros(S, T, dtype=torch.long, device=device)
            r[seg, slot], g[seg, slot] = row, group
            maps.append((side, r.view(B, H, T), g.view(B, H, T), seg, slot))
        (ks, kr, kg, seg, slot), (vs, vr, vg, _, _) = maps
        bias = torch.full((S, T), float("-inf"), device=device)
        bias[seg, slot] = 0.0
        return QuantizedSegment(ks, vs, kr, kg, vr, vg, bias.view(B, H, T))

    def attend(self, query: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query [B, Hq, Q, D]`` over the held cache, read from the codes (no dequantized copy).

        Returns ``(out fp32 [B, Hq, Q, D], lse fp32 [B, Hq, Q])``, equal to
        ``kvcore.reference_attention(self.read(), query, scale)``. Non-uniform quantizers fall back to that.
        """
        if self._shape is None:
            raise ValueError("attend() on an empty store: write() or append() first")
        B, H, D = self._shape
        q = check_query(query, H, D, B)
        scale = check_scale(scale, D)
        segment = self.quantized_segment()
        if segment is None:
            return reference_attention(self.read(), q, scale)
        return quantized_attention(q.to(segment.bias.device), segment, scale)

    def reset(self) -> None:
        """Drop everything and free the memory."""
        self._shape: tuple[int, int, int] | None = None  # (B, H, D)
        self._dtype: torch.dtype | None = None
        self._last_pos: torch.Tensor | None = None  # [B] largest position held per batch row (-1: none)
        self._parts: dict[str, tuple[FullRows, QuantUnits, Residual]] = {}

    def _empty_parts(
        self, B: int, H: int, D: int, dtype: torch.dtype, device: torch.device
    ) -> dict[str, tuple[FullRows, QuantUnits, Residual]]:
        empty = torch.zeros(B, H, 0, D, dtype=dtype, device=device)
        none = torch.zeros(B, H, 0, dtype=torch.bool, device=device)
        idx = torch.zeros(B, H, 0, dtype=torch.int32, device=device)
        return {
            kind: (
                FullRows.from_mask(empty, none, idx),
                QuantUnits(q, self._unit(q)),
                Residual.from_mask(empty, none, idx),
            )
            for kind, q in (("k", self.key_quantizer), ("v", self.value_quantizer))
        }

    @staticmethod
    def _unit(q: Quantizer) -> int:
        return q.group_size if q.axis == "channel" else 1

    @property
    def _segments(self) -> int:
        B, H, _ = self._shape
        return B * H

    # -- checks ----------------------------------------------------------------------------------------
    def _check_kv(self, keys: torch.Tensor, values: torch.Tensor, *, held: bool) -> None:
        """Float ``[B, H, T, D]`` keys and values of one dtype, shape and device; with ``held``, matching the held
        cache."""
        check_float("keys", check_tensor("keys", keys, ndim=4))
        check_tensor("values", values, ndim=4)
        if values.shape != keys.shape or values.dtype != keys.dtype or values.device != keys.device:
            raise ValueError(
                f"values {values.dtype} {tuple(values.shape)} must match keys {keys.dtype} {tuple(keys.shape)}"
            )
        if held and self._shape is not None:
            B, H, D = self._shape
            if keys.shape[:2] != (B, H) or keys.shape[-1] != D or keys.dtype != self._dtype:
                raise ValueError(
                    f"keys {keys.dtype} {tuple(keys.shape)} do not match the stored cache [B={B}, H={H}, *, D={D}] "
                    f"{self._dtype}"
                )

    # -- protocol --------------------------------------------------------------------------------------
    def write(self, keys: torch.Tensor, values: torch.Tensor, plan: Plan, positions: torch.Tensor) -> None:
        """Replace the content with ``keys``/``values [B, H, T, D]`` laid out per ``plan`` (see class doc).

        Everything is validated (finite kept entries, positions as :func:`kvcore.checks.check_positions`) and the new
        content built before the held one is replaced: a call that raises leaves the store as it was."""
        self._check_kv(keys, values, held=False)
        B, H, T, D = keys.shape
        if not isinstance(plan, Plan) or tuple(plan.key_bits.shape) != (B, H, T):
            raise ValueError(f"plan must be a kvcore.Plan of shape [B={B}, H={H}, T={T}]")
        if plan.full_precision is not None:
            raise ValueError("KIVIStore does not hold element-level full-precision masks (plan.full_precision)")
        kb, vb = plan.key_bits.to(keys.device), plan.bits_for_values.to(keys.device)
        for name, bits, q in (("key_bits", kb, self.key_quantizer), ("value_bits", vb, self.value_quantizer)):
            tiers = set(torch.unique(bits).tolist())
            allowed = {EVICT, FULL, q.bits}
            if tiers - allowed:
                raise ValueError(f"plan.{name} uses tiers {sorted(tiers)}; this KIVIStore holds {sorted(allowed)}")
        keep = kb != EVICT
        if not torch.equal(keep, vb != EVICT):
            raise ValueError("KIVIStore needs the same kept entries for keys and values (tiers may differ)")
        positions = check_positions("positions", positions, (B, T), keep=keep).to(keys.device)
        check_finite("keys (kept entries)", keys[keep])
        check_finite("values (kept entries)", values[keep])
        if (
            bool((keep.sum(-1) > self.residual).any())
            and not bool(((kb != EVICT) & (kb != FULL)).any())
            and not bool(((vb != EVICT) & (vb != FULL)).any())
        ):
            warnings.warn(
                f"KIVIStore.write: the plan keeps more than residual={self.residual} entries of a head but quantizes "
                "none of them, so this store holds a full-precision cache. Pair KIVIStore with KIVITierSelector "
                "(it lays kept entries out as KIVI does), or build the compressor with kv_baselines.kivi(bits, "
                "evict=<an evicting Compressor>).",
                KIVIUnquantizedWarning,
                stacklevel=2,
            )
        parts = self._empty_parts(B, H, D, keys.dtype, keys.device)
        pos = positions[:, None, :].expand(B, H, T).int()
        for kind, x, bits, q in (("k", keys, kb, self.key_quantizer), ("v", values, vb, self.value_quantizer)):
            quant, resid, full = self._roles(bits, q.bits, kind)
            units = parts[kind][1]
            entries, _ = compact_entries(x, quant, pos)
            units.add(*QuantUnits.gather_units(entries, B * H, units.unit))
            parts[kind] = (FullRows.from_mask(x, full, pos), units, Residual.from_mask(x, resid, pos))
        self.reset()
        self._dtype = keys.dtype
        self._commit(parts, (B, H, D))

    def _roles(self, bits: torch.Tensor, qbits: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a ``[B, H, T]`` tier tensor into (quantized, residual, permanent full) masks."""
        T = bits.shape[-1]
        quant = bits == qbits
        full = bits == FULL
        idx = torch.arange(T, device=bits.device)
        last_q = torch.where(quant, idx, -1).amax(-1, keepdim=True) if T else idx[None, None, :1]
        run = full & (idx > last_q)
        m = run.sum(-1, keepdim=True)
        r = m % self.residual if kind == "k" else m.clamp_max(self.residual)
        from_end = run.flip(-1).cumsum(-1).flip(-1)  # run entries at or after t
        resid = run & (from_end <= r)
        return quant, resid, full & ~resid

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add ``[B, H, n, D]`` new entries through the residuals (KIVI's decode-time policy, class doc).

        Finite keys/values and positions after every held one in their row (``positions [B, n]``) are required;
        the residual flushes run on copies of the parts, so a failing quantization leaves the store unchanged."""
        self._check_kv(keys, values, held=True)
        B, H, n, D = keys.shape
        last = None if self._shape is None else self._last_pos
        positions = check_positions("positions", positions, (B, n), after=last).to(keys.device)
        check_finite("keys", keys)
        check_finite("values", values)
        parts = self._empty_parts(B, H, D, keys.dtype, keys.device) if self._shape is None else self._staged()
        S = B * H
        pos = positions[:, None, :].expand(B, H, n).reshape(S, n)
        R = self.residual
        # keys: grow the residual to R, then quantize whole blocks of R per channel
        _, kunits, kres = parts["k"]
        kres.push(keys.reshape(S, n, D), pos)
        while bool((kres.length >= R).any()):
            block = kres.pop_front(torch.where(kres.length >= R, R, 0))
            kunits.add(*QuantUnits.gather_units(block, S, kunits.unit))
        # values: FIFO of R, the oldest overflow is quantized per token
        _, vunits, vres = parts["v"]
        vres.push(values.reshape(S, n, D), pos)
        over = (vres.length - R).clamp_min(0)
        if bool(over.any()):
            vunits.add(*QuantUnits.gather_units(vres.pop_front(over), S, vunits.unit))
        self._dtype = keys.dtype
        self._commit(parts, (B, H, D))

    def read(self, query: torch.Tensor | None = None) -> KVView:
        """Dequantized, position-ordered view; heads padded with ``-inf`` bias and position ``-1``."""
        if self._shape is None:
            raise ValueError("read() on an empty store: write() or append() first")
        B, H, D = self._shape
        S = B * H
        out = {}
        for kind in ("k", "v"):
            full, units, resid = self._parts[kind]
            rows, seg, pos = _cat([full.entries(), units.entries(), resid.entries()])
            perm = torch.argsort((seg.long() << 32) | pos.long())
            rows, seg, pos = rows[perm], seg[perm], pos[perm]
            slot, counts = rank_in_segment(seg, S)
            out[kind] = (rows, seg, slot, pos, counts)
        rows_k, seg, slot, pos, counts = out["k"]
        rows_v = out["v"][0]
        if not torch.equal(counts, out["v"][4]):  # pragma: no cover - internal invariant
            raise RuntimeError("KIVIStore: keys and values hold different entries")
        T = int(counts.max()) if counts.numel() else 0
        device = rows_k.device
        k = torch.zeros(S, T, D, dtype=self._dtype, device=device)
        v = torch.zeros(S, T, D, dtype=self._dtype, device=device)
        positions = torch.full((S, T), -1, dtype=torch.long, device=device)
        k[seg, slot], v[seg, slot], positions[seg, slot] = rows_k, rows_v, pos.long()
        bias = torch.zeros(S, T, device=device).masked_fill(positions < 0, float("-inf"))
        return KVView(k.view(B, H, T, D), v.view(B, H, T, D), positions.view(B, H, T), bias.view(B, H, T))

    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes of every tensor this store holds (codes, scales, zeros, residuals, positions, indices)."""
        return reachable_bytes(self, device)

    def seq_lengths(self) -> torch.Tensor:
        """``[B, H]`` entries held per head."""
        if self._shape is None:
            return torch.zeros(0, 0, dtype=torch.long)
        B, H, _ = self._shape
        full, units, resid = self._parts["k"]
        device = resid.length.device
        return (full.counts + units.counts(B * H, device) + resid.length).view(B, H)

    def entry_counts(self) -> dict[str, torch.Tensor]:
        """``[B, H]`` entries per tier: ``keys_quantized``, ``keys_full``, ``keys_residual`` and the same for values.

        ``*_full`` counts every full-precision entry (the residual included); ``*_residual`` the residual only.
        """
        if self._shape is None:
            return {}
        B, H, _ = self._shape
        out = {}
        for kind, name in (("k", "keys"), ("v", "values")):
            full, units, resid = self._parts[kind]
            device = resid.length.device
            out[f"{name}_quantized"] = units.counts(B * H, device).view(B, H)
            out[f"{name}_residual"] = resid.length.view(B, H).clone()
            out[f"{name}_full"] = (full.counts + resid.length).view(B, H)
        return out

    def crop(self, position: int) -> None:
        """Drop every entry whose true position is ``>= position``.

        A per-channel key group cut by ``position`` keeps its scale and zero and drops the code rows past the cut
        (nothing is re-quantized); groups left without entries are freed.
        """
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
        check_integer_tensor("index", index, ndim=1)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= B):
            raise ValueError(f"index must hold batch rows in [0, {B}), got {index.tolist()}")
        device = self._parts["k"][2].length.device
        take = (index.to(device).long()[:, None] * H + torch.arange(H, device=device)).flatten()
        parts = self._staged()
        for staged in parts.values():
            for part in staged:
                part.take_segments(take, B * H)
        self._commit(parts, (index.numel(), H, D))
