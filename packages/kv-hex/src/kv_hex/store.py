"""The HEX KV cache of one layer as a ``kvcore.Store`` (HEX §3.5, §4.1)."""

from __future__ import annotations

import math

import torch

from kv_hex.config import HEXConfig
from kv_hex.kernels import dispatch
from kv_hex.layout import PartLayout, concat_layouts, decode_segment, residual_layout, segment_layout
from kv_hex.segment import Segment, compact, compress_segment, share_stack, stack_segments, uniform_length
from kv_hex.segment_attention import residual_attention, segment_attention, segments_attention, stackable
from kv_hex.selector import hex_tiers
from kv_hex.uniform import UniformCall, uniform_part
from kvcodec.narrow import narrow, narrow_positions
from kvcodec.segments import segment_ids
from kvcore import (
    EVICT,
    FULL,
    KVView,
    Plan,
    Store,
    check_retier_plan,
    check_write_plan,
    merge_attention,
    reachable_bytes,
)
from kvcore.attention import check_query, check_scale
from kvcore.checks import (
    check_append,
    check_batch_index,
    check_finite,
    check_int,
    check_kv,
    check_positions,
)

__all__ = ["HEXStore"]

_RAGGED = -1  # HEXStore._res_T: the residual's heads hold different numbers of entries
_STACK_TOKENS = 2048  # CPU attend: decode blocks of one size dequantized together, up to this many slots a call


class HEXStore(Store):
    """HEX's cache: KCVT codes, whole full-precision rows (heavy hitters, recent), the static expander overlay and
    an fp16 residual of fewer than ``block_size`` tokens (HEX §3.5, §4.1). HEX evicts nothing; this store follows
    any eviction a plan asks for too (evicted entries hold no memory).

    ``write(keys, values, plan, positions)``: the trailing ``T mod block_size`` slots go to the fp16 residual when
    the plan keeps all their entries ``FULL`` (HEX's prefill layout, :class:`~kv_hex.HEXSelector`: they are
    compressed when decoding fills the block, as in the paper's streaming setup, §4.1); every other slot becomes one
    compressed segment laid out exactly as ``plan`` says (``FULL`` rows bit-exact, ``bits`` rows KCVT-coded with the
    expander overlay kept in full precision, ``EVICT`` dropped). ``plan.full_precision`` must be
    ``None``: the element-level mask is the store's static expander mask (regenerated from ``(n, d, ρ, seed)``,
    never stored as a dense bool).

    ``append`` adds tokens to the residual; when a batch row holds ``block_size`` residual tokens they are
    compressed: heavy hitters by the attention accumulated through :meth:`attend` (summed over every head; spec A5)
    and the last ``recent`` tokens whole in full precision, the rest KCVT with the expander overlay. In
    ``mode="append"`` earlier segments' bytes never change; in ``mode="full"`` the whole cache is re-compressed, from
    its held representation, as one segment (spec A10).

    ``attend(query, scale)`` equals ``kvcore.reference_attention(self.read(), query, scale)`` without rebuilding the
    view (each segment and the residual attended by the fused kernel, merged by log-sum-exp) and adds each entry's
    attention probability (summed over queries and the GQA group) to the accumulator heavy hitters are chosen by.

    Parameters
    ----------
    config : HEXConfig, optional
        Defaults to ``HEXConfig()`` (HEX-3).
    """

    can_attend = True
    can_demote = False

    def __init__(self, config: HEXConfig | None = None) -> None:
        cfg = HEXConfig() if config is None else config
        if not isinstance(cfg, HEXConfig):
            raise TypeError(f"config must be a kv_hex.HEXConfig, got {type(cfg).__name__}")
        self.config = cfg
        self.supported_bits = frozenset({EVICT, FULL, cfg.bits})
        self.reset()

    # -- state -----------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop everything and free the memory."""
        self._shape: tuple[int, int, int] | None = None  # (B, H, D)
        self._dtype: torch.dtype | None = None
        self._segments: list[Segment] = []
        self._res: dict[str, torch.Tensor | None] = {}
        self._last_pos: torch.Tensor | None = None
        self._res_distinct: list[int] | None = None  # distinct residual positions per batch row, when known
        self._res_T: int | None = None  # residual entries of every head when all hold as many, _RAGGED; None: unknown
        # stacks of decode blocks kept between calls (kv_hex.segment.share_stack): (blocks, stack) by block ids
        self._stack_cache: dict[tuple[int, ...], tuple[tuple[Segment, ...], Segment]] = {}

    def _empty_residual(self, S: int, D: int, dtype, device) -> dict[str, torch.Tensor | None]:
        return {
            "counts": torch.zeros(S, dtype=torch.long, device=device),
            "pos": torch.zeros(0, dtype=torch.int16, device=device),
            "k": torch.zeros(0, D, dtype=dtype, device=device),
            "v": torch.zeros(0, D, dtype=dtype, device=device),
            "acc": None,
        }

    def _parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(seg, pos)`` of each part's entries: the segments in order, then the residual."""
        out = [(s.seg(), s.pos.int()) for s in self._segments]  # int16 or int32 held, int32 here
        out.append((segment_ids(self._res["counts"], self._res["pos"].numel()), self._res["pos"].int()))
        return out

    def _order(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Read layout of the concatenated parts: ``(perm, seg, slot, T)`` sorted by ``(seg, pos)``."""
        parts = self._parts()
        seg = torch.cat([s for s, _ in parts]).long()
        pos = torch.cat([p for _, p in parts]).long()
        perm = torch.argsort((seg << 32) | pos)
        seg_sorted = seg[perm]
        S = self._shape[0] * self._shape[1]
        counts = torch.bincount(seg_sorted, minlength=S)
        slot = torch.arange(seg_sorted.numel(), device=seg.device) - (torch.cumsum(counts, 0) - counts)[seg_sorted]
        T = int(counts.max()) if counts.numel() and seg.numel() else 0
        return perm, seg_sorted, slot, T

    def _commit(
        self, segments: list[Segment], res: dict, shape=None, dtype=None, last=None, distinct=None, res_T=None
    ) -> None:
        """Make the new parts the held state (the last step of every mutation: all-or-nothing). ``last [B]`` (each
        batch row's last position) is recomputed unless given; ``distinct`` (the residual's distinct positions per
        batch row, on the host) and ``res_T`` (the residual's entries per head when every head holds as many) are
        forgotten unless given."""
        if shape is not None:
            self._shape, self._dtype = shape, dtype
        self._segments, self._res = segments, res
        self._res_distinct = distinct
        self._res_T = res_T
        self._keep_stacks()
        if last is not None:
            self._last_pos = last
            return
        B = self._shape[0]
        device = res["pos"].device
        last = torch.full((B,), -1, dtype=torch.long, device=device)
        H = self._shape[1]
        for seg, pos in self._parts():
            if pos.numel():
                last = last.scatter_reduce(0, seg.long() // H, pos.long(), reduce="amax")
        self._last_pos = last

    # -- checks ----------------------------------------------------------------------------------------
    def _check_kv(self, keys: torch.Tensor, values: torch.Tensor, *, held: bool) -> None:
        check_kv(keys, values, held=(*self._shape, self._dtype) if held and self._shape is not None else None)

    # -- protocol: write / append ----------------------------------------------------------------------
    def write(self, keys: torch.Tensor, values: torch.Tensor, plan: Plan, positions: torch.Tensor) -> None:
        """Replace the content (see the class docstring). All-or-nothing."""
        self._check_kv(keys, values, held=False)
        B, H, T, D = keys.shape
        kb, vb = check_write_plan(
            plan,
            (B, H, T),
            keys.device,
            "HEXStore",
            key_tiers={EVICT, FULL, self.config.bits},
            same_kept=True,
            full_precision_note=": it derives its element-level mask from its config (the static expander mask)",
        )
        keep = kb != EVICT
        positions = check_positions("positions", positions, (B, T), keep=keep).to(keys.device)
        check_finite("keys (kept entries)", keys[keep])
        check_finite("values (kept entries)", values[keep])
        end = T - T % self.config.block_size
        tail = keep[:, :, end:]
        if bool((tail & ((kb[:, :, end:] != FULL) | (vb[:, :, end:] != FULL))).any()):
            end = T  # the plan codes a trailing entry: no residual, everything follows the plan now
        held_slot = keep[:, :, :end].any(1)
        slot_pos = torch.where(held_slot, positions[:, :end], -1)
        acc = torch.zeros(B, H, end, device=keys.device) if self.config.mode == "full" else None
        segment = compress_segment(
            self.config, keys[:, :, :end], values[:, :, :end], kb[:, :, :end], vb[:, :, :end], slot_pos, acc
        )
        if acc is not None and not segment.coded and segment.pos.numel() == 0:
            segment.acc = None
        rk = keep[:, :, end:]
        res = {
            "counts": rk.reshape(B * H, -1).sum(-1),
            "pos": narrow(positions[:, None, end:].expand(B, H, T - end)[rk]),
            "k": keys[:, :, end:][rk].clone(),
            "v": values[:, :, end:][rk].clone(),
            "acc": None,
        }
        self._commit([segment], res, (B, H, D), keys.dtype)

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add ``[B, H, n, D]`` tokens to the residual; full blocks are compressed (class docstring). All-or-nothing."""
        self._check_kv(keys, values, held=True)
        B, H, n, D = keys.shape
        last = None if self._shape is None else self._last_pos
        positions = check_append(keys, values, positions, last)
        S = B * H
        if self._shape is None:
            res = self._empty_residual(S, D, keys.dtype, keys.device)
            segments: list[Segment] = []
        else:
            res, segments = dict(self._res), list(self._segments)
        T0 = self._res_T if self._shape is not None else None
        if T0 is not None and T0 != _RAGGED:
            res = self._grow_uniform(res, keys, values, positions, T0)
        else:
            seg = torch.cat(
                [
                    segment_ids(res["counts"], res["pos"].numel()),
                    torch.arange(S, device=keys.device).repeat_interleave(n),
                ]
            )
            pos = torch.cat([res["pos"].int(), positions[:, None, :].expand(B, H, n).reshape(-1).int()])
            pos = narrow_positions(pos, like=keys)  # read only where the value checks run
            order = torch.argsort((seg.long() << 32) | pos.long())
            new_acc = None
            if res["acc"] is not None:
                new_acc = torch.cat([res["acc"], torch.zeros(S * n, device=keys.device)])[order]
            res = {
                "counts": torch.bincount(seg, minlength=S),
                "pos": pos[order],
                "k": torch.cat([res["k"], keys.reshape(S * n, D)])[order],
                "v": torch.cat([res["v"], values.reshape(S * n, D)])[order],
                "acc": new_acc,
            }
        new_last = positions.long().amax(1)  # past every held position (checked above, or promised)
        if self._shape is None:
            self._shape, self._dtype = (B, H, D), keys.dtype
            try:
                segments, res, distinct, res_T = self._flush(segments, res, None, n)
            except Exception:
                self._shape, self._dtype = None, None
                raise
            self._commit(segments, res, last=new_last, distinct=distinct, res_T=res_T)
            return
        # each batch row gains n new distinct positions, each head n entries
        distinct = None if self._res_distinct is None else [c + n for c in self._res_distinct]
        res_T = self._res_T + n if self._res_T is not None and self._res_T != _RAGGED else None
        segments, res, distinct, res_T = self._flush(segments, res, distinct, res_T)
        self._commit(segments, res, last=torch.maximum(last, new_last), distinct=distinct, res_T=res_T)

    @staticmethod
    def _grow_uniform(res: dict, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, T0: int) -> dict:
        """The residual after an append when each of its heads holds ``T0`` entries: every head gains the ``n`` new
        tokens after its own (their positions follow every held one), so each tensor grows by one concatenation per
        head, with no sort (what a decode step does on a GPU)."""
        B, H, n, D = keys.shape
        S = B * H
        new_pos = positions[:, None, :].expand(B, H, n).reshape(S, n).int()
        pos = torch.cat([res["pos"].int().view(S, T0), new_pos], 1).view(-1)
        acc = res["acc"]
        if acc is not None:
            acc = torch.cat([acc.view(S, T0), acc.new_zeros(S, n)], 1).view(-1)
        return {
            "counts": res["counts"] + n,
            "pos": narrow_positions(pos, like=keys),  # read only where the value checks run
            "k": torch.cat([res["k"].view(S, T0, D), keys.reshape(S, n, D)], 1).view(S * (T0 + n), D),
            "v": torch.cat([res["v"].view(S, T0, D), values.reshape(S, n, D)], 1).view(S * (T0 + n), D),
            "acc": acc,
        }

    # -- streaming compression -------------------------------------------------------------------------
    def _flush(
        self, segments: list[Segment], res: dict, distinct: list[int] | None, res_T: int | None
    ) -> tuple[list[Segment], dict, list[int], int | None]:
        """Compress every full block of the residual (rows with ``block_size`` distinct residual positions).

        ``distinct``: the residual's distinct positions per batch row when the caller knows them on the host (then
        a step that fills no block reads nothing), else ``None`` (found on the device). ``res_T``: the residual's
        entries per head when the caller knows every head holds as many, else ``None``. Returns both after the
        flush (``res_T`` known when every head held every position of its row and every row flushed alike)."""
        B, H, D = self._shape
        nb = self.config.block_size
        while True:
            if distinct is not None and max(distinct, default=0) < nb:
                return segments, res, distinct, res_T
            seg = segment_ids(res["counts"], res["pos"].numel())
            row = seg // H
            pos = res["pos"].long()
            first: list[torch.Tensor | None] = []
            sizes = []
            for b in range(B):
                u = torch.unique(pos[row == b])
                sizes.append(u.numel())
                first.append(u[:nb] if u.numel() >= nb else None)
            if all(f is None for f in first):
                return segments, res, sizes, res_T
            # every head held all of its row's positions (res_T of them) and every row flushes: each loses nb
            uniform = res_T is not None and all(f is not None and c == res_T for c, f in zip(sizes, first))
            res_T = res_T - nb if uniform else None
            distinct = [n - nb if f is not None else n for n, f in zip(sizes, first)]
            slot_pos = torch.full((B, nb), -1, dtype=torch.long, device=pos.device)
            for b, f in enumerate(first):
                if f is not None:
                    slot_pos[b] = f
            flush = torch.zeros_like(pos, dtype=torch.bool)
            slot = torch.zeros_like(pos)
            for b in range(B):
                if first[b] is None:
                    continue
                sel = (row == b) & (pos <= first[b][-1])
                flush |= sel
                slot[sel] = torch.searchsorted(first[b], pos[sel])
            h = seg % H
            k = torch.zeros(B, H, nb, D, dtype=self._dtype, device=pos.device)
            v = torch.zeros_like(k)
            held = torch.zeros(B, H, nb, dtype=torch.bool, device=pos.device)
            acc = torch.zeros(B, H, nb, device=pos.device)
            idx = (row[flush], h[flush], slot[flush])
            k[idx], v[idx], held[idx] = res["k"][flush], res["v"][flush], True
            if res["acc"] is not None:
                acc[idx] = res["acc"][flush]
            keep = ~flush
            res = {
                "counts": torch.bincount(seg[keep], minlength=B * H),
                "pos": res["pos"][keep],
                "k": res["k"][keep],
                "v": res["v"][keep],
                "acc": None if res["acc"] is None else res["acc"][keep],
            }
            if self.config.mode == "append":
                segments = [*segments, self._compress(k, v, held, slot_pos, acc)]
            else:
                segments = [self._recompress(segments, k, v, held, slot_pos, acc)]

    def _compress(self, k, v, held, slot_pos, acc) -> Segment:
        """HEX compression of one dense staging ``[B, H, n, D]``: global heavy hitters + recent whole in full
        precision, the rest KCVT with the overlay."""
        cfg = self.config
        n = k.shape[2]
        scores = acc.masked_fill(~held, 0.0).sum(1, keepdim=True).expand_as(acc)
        tiers = hex_tiers(scores, held, torch.zeros_like(held), cfg.bits, cfg.heavy_ratio, cfg.recent, max(n, 1))
        return compress_segment(cfg, k, v, tiers, tiers, slot_pos, acc if cfg.mode == "full" else None)

    def _recompress(self, segments, k, v, held, slot_pos, acc) -> Segment:
        """Full mode: the held segments (reconstructed from their codes) and the new block as one segment."""
        B, H, D = self._shape
        parts = [decode_segment(self.config, s, self.config.bits) for s in segments]
        accs = [s.acc if s.acc is not None else torch.zeros(s.num_entries, device=k.device) for s in segments]
        sh = torch.nonzero(held, as_tuple=True)
        rows_k = torch.cat([p[0] for p in parts] + [k[sh]])
        rows_v = torch.cat([p[1] for p in parts] + [v[sh]])
        segid = torch.cat([p[2] for p in parts] + [sh[0] * H + sh[1]])
        pos = torch.cat([p[3].long() for p in parts] + [slot_pos[sh[0], sh[2]]])
        a = torch.cat([*accs, acc[sh]])
        row = segid // H
        uniq = [torch.unique(pos[row == b]) for b in range(B)]
        n = max(int(u.numel()) for u in uniq)
        sp = torch.full((B, n), -1, dtype=torch.long, device=k.device)
        slot = torch.zeros_like(pos)
        for b, u in enumerate(uniq):
            sp[b, : u.numel()] = u
            sel = row == b
            slot[sel] = torch.searchsorted(u, pos[sel])
        K = torch.zeros(B, H, n, D, dtype=self._dtype, device=k.device)
        V = torch.zeros_like(K)
        HELD = torch.zeros(B, H, n, dtype=torch.bool, device=k.device)
        ACC = torch.zeros(B, H, n, device=k.device)
        idx = (row, segid % H, slot)
        K[idx], V[idx], HELD[idx], ACC[idx] = rows_k, rows_v, True, a
        return self._compress(K, V, HELD, sp, ACC)

    # -- protocol: read / tiers / retier ---------------------------------------------------------------
    def _entries(self) -> tuple[torch.Tensor, ...]:
        """``(keys, values, key tiers, value tiers)`` of every held entry, parts concatenated (segments, residual)."""
        bits = self.config.bits
        ks, vs, kt, vt = [], [], [], []
        for s in self._segments:
            k, v, _, _ = decode_segment(self.config, s, bits)
            ks.append(k)
            vs.append(v)
            kt.append(torch.where(s.full("k"), FULL, bits).to(torch.uint8))
            vt.append(torch.where(s.full("v"), FULL, bits).to(torch.uint8))
        r = self._res
        ks.append(r["k"])
        vs.append(r["v"])
        kt.append(torch.full_like(r["pos"], FULL, dtype=torch.uint8))
        vt.append(torch.full_like(r["pos"], FULL, dtype=torch.uint8))
        return torch.cat(ks), torch.cat(vs), torch.cat(kt), torch.cat(vt)

    def read(self, query: torch.Tensor | None = None) -> KVView:
        """Every held entry, reconstructed (full-precision rows and overlay elements bit-exact), at its true
        position, per head in position order; ragged heads padded with position ``-1`` and bias ``-inf``."""
        if self._shape is None:
            raise ValueError("read() on an empty store: write() or append() first")
        B, H, D = self._shape
        S = B * H
        perm, seg, slot, T = self._order()
        k, v, _, _ = self._entries()
        pos = torch.cat([p for _, p in self._parts()]).long()
        device = k.device
        K = torch.zeros(S, T, D, dtype=self._dtype, device=device)
        V = torch.zeros_like(K)
        P = torch.full((S, T), -1, dtype=torch.long, device=device)
        K[seg, slot], V[seg, slot], P[seg, slot] = k[perm], v[perm], pos[perm]
        bias = torch.zeros(S, T, device=device).masked_fill(P < 0, float("-inf"))
        return KVView(K.view(B, H, T, D), V.view(B, H, T, D), P.view(B, H, T), bias.view(B, H, T))

    def tiers(self) -> Plan:
        """The tier of every held entry (``FULL`` or ``bits``; the residual is ``FULL``), laid out like :meth:`read`.
        Overlay elements are part of their coded entry's tier (``bits``)."""
        if self._shape is None:
            raise ValueError("tiers() on an empty store: write() or append() first")
        B, H, _ = self._shape
        perm, seg, slot, T = self._order()
        _, _, kt, vt = self._entries_tiers()
        out = []
        for t in (kt, vt):
            bits = torch.zeros(B * H, T, dtype=torch.uint8, device=t.device)
            bits[seg, slot] = t[perm]
            out.append(bits.view(B, H, T))
        return Plan(out[0], out[1])

    def _entries_tiers(self):
        bits = self.config.bits
        kt = [torch.where(s.full("k"), FULL, bits).to(torch.uint8) for s in self._segments]
        vt = [torch.where(s.full("v"), FULL, bits).to(torch.uint8) for s in self._segments]
        kt.append(torch.full_like(self._res["pos"], FULL, dtype=torch.uint8))
        vt.append(torch.full_like(self._res["pos"], FULL, dtype=torch.uint8))
        return None, None, torch.cat(kt), torch.cat(vt)

    def _keep_parts(self, keep: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[list[Segment], dict]:
        """New parts holding the entries where ``keep`` (over the concatenated parts, part order); ``rows``:
        the old batch row of each new row (reorder; ``keep`` is then ignored)."""
        B, H, _ = self._shape
        segments, start = [], 0
        parts = self._parts()
        for s, (seg, _) in zip(self._segments, parts):
            n = s.num_entries
            if rows is None:
                k = keep[start : start + n]
                idx = torch.nonzero(k).flatten()
                counts = torch.bincount(seg[k], minlength=B * H)
            else:
                idx, counts = self._take_rows(seg, s.counts, rows)
            segments.append(s.take(self.config, idx, counts, rows))
            start += n
        seg, _ = parts[-1]
        r = self._res
        if rows is None:
            k = keep[start:]
            idx = torch.nonzero(k).flatten()
            counts = torch.bincount(seg[k], minlength=B * H)
        else:
            idx, counts = self._take_rows(seg, r["counts"], rows)
        res = {
            "counts": counts,
            "pos": r["pos"][idx].clone(),
            "k": r["k"][idx].clone(),
            "v": r["v"][idx].clone(),
            "acc": None if r["acc"] is None else r["acc"][idx].clone(),
        }
        return segments, res

    def _take_rows(self, seg: torch.Tensor, counts: torch.Tensor, rows: torch.Tensor):
        H = self._shape[1]
        take = (rows[:, None] * H + torch.arange(H, device=rows.device)).flatten()
        start = torch.cumsum(counts, 0) - counts
        n = counts[take]
        off = torch.repeat_interleave(start[take] - (torch.cumsum(n, 0) - n), n)
        return torch.arange(int(n.sum()), device=seg.device) + off, n

    def retier(self, plan: Plan) -> None:
        """Evict the entries ``plan`` marks ``EVICT`` (laid out like :meth:`read`); every other entry keeps its
        tier and bytes. Another tier, kept padding or different kept sets for keys and values raise ``ValueError``
        and change nothing."""
        if self._shape is None:
            raise ValueError("retier() on an empty store: write() or append() first")
        if isinstance(plan, Plan) and plan.full_precision is not None:
            raise ValueError("HEXStore.retier takes no plan.full_precision (the overlay is the static mask)")
        kb, _ = check_retier_plan(plan, self.tiers(), "HEXStore", eviction_only=True, same_kept=True)
        perm, seg, slot, _ = self._order()
        keep_sorted = (kb != EVICT).flatten(0, 1)[seg, slot]
        keep = torch.empty_like(keep_sorted)
        keep[perm] = keep_sorted
        segments, res = self._keep_parts(keep)
        self._commit(segments, res)

    # -- fused attention -------------------------------------------------------------------------------
    def _layouts(self, bound: bool = False, which: list[int] | None = None) -> list[PartLayout]:
        """Every part addressed for the kernels: the segments in order, then the residual (``which``: only the
        parts of these indices, ``len(segments)`` being the residual). ``bound``: the residual's ``T`` may be an
        upper bound known on the host (its rows' distinct positions: a head holds no more), which spares a host
        read; the Triton kernel masks each head by its own count."""
        B, H, D = self._shape
        n = len(self._segments)
        which = list(range(n + 1)) if which is None else which
        T = max(self._res_distinct, default=0) if bound and self._res_distinct is not None else None
        return [
            segment_layout(self.config, self._segments[i])
            if i < n
            else residual_layout(self._res, B, H, D, self.config.bits, T)
            for i in which
        ]

    def _keep_stacks(self) -> None:
        """Keep the cached stacks whose blocks are all still held; the held blocks of a dropped stack get storages of
        their own again (kv_hex.segment.compact), so no dropped entry's bytes stay reachable."""
        held = {id(s) for s in self._segments}
        kept = {}
        for key, (blocks, stack) in self._stack_cache.items():
            if all(id(b) in held for b in blocks):
                kept[key] = (blocks, stack)
            else:
                for b in blocks:
                    if id(b) in held:
                        compact(b)
        self._stack_cache = kept

    def _stack(self, idx: list[int]) -> Segment:
        """The decode blocks ``idx`` as one segment (:func:`kv_hex.segment.stack_segments`), built once per set of
        blocks: the blocks then hold views of the stack (:func:`kv_hex.segment.share_stack`), so later calls copy
        nothing and the stack holds no bytes of its own. Keys are the blocks' identities, valid while the cache
        holds them (it keeps only stacks whose blocks are all held, see :meth:`_keep_stacks`)."""
        blocks = tuple(self._segments[i] for i in idx)
        key = tuple(id(b) for b in blocks)
        hit = self._stack_cache.get(key)
        if hit is not None and all(a is b for a, b in zip(hit[0], blocks)):
            return hit[1]
        stack = stack_segments(list(blocks))
        if share_stack(list(blocks), stack):
            # an older stack of some of these blocks (the set before a new block) no longer backs them: drop it
            ids = set(key)
            self._stack_cache = {k: v for k, v in self._stack_cache.items() if ids.isdisjoint(k)}
            self._stack_cache[key] = (blocks, stack)
        return stack

    def _residual_T(self) -> int:
        """Entries of every residual head when all hold as many (0 when empty), else ``_RAGGED``: known on the host
        through appends (each head gains the same entries); after any other mutation read once and remembered."""
        if self._res_T is None:
            N = int(self._res["pos"].numel())
            T = uniform_length(self._res["counts"], N) if N else 0
            self._res_T = _RAGGED if T is None else T
        return self._res_T

    def _stacks(self, segments: list[int], cap: int | None, least: int = 2) -> tuple[list[list[int]], list[int]]:
        """The held segments ``segments`` (indices) split into stacks of at least ``least`` decode blocks of one size
        (:func:`kv_hex.segment_attention.stackable`), each of at most ``cap`` slots when given, and the rest."""
        by_size: dict[int, list[list[int]]] = {}
        rest = []
        for i in segments:
            seg = self._segments[i]
            if stackable(seg) is None:
                rest.append(i)
                continue
            group = by_size.setdefault(seg.n, [[]])
            if cap is not None and (len(group[-1]) + 1) * seg.n > max(cap, seg.n):
                group.append([])
            group[-1].append(i)
        groups = [g for size in by_size.values() for g in size]
        stacks = [g for g in groups if len(g) >= least]
        rest = sorted(rest + [i for g in groups if len(g) < least for i in g])
        return stacks, rest

    def attend(self, query: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query [B, Hq, Q, D]`` over the held cache: ``(out fp32, lse fp32)`` equal to
        ``kvcore.reference_attention(self.read(), query, scale)``, without rebuilding the dequantized cache.

        Decode blocks of one size (append mode writes one per ``block_size`` tokens) are attended as one stack
        (:func:`kv_hex.segment_attention.segments_attention`: stacked as the batch rows of one segment, nothing
        re-quantized, the query repeated per block, merged by log-sum-exp), so the operations per step do not grow
        with the blocks. On CUDA every other part (the prompt's segment and the residual) is addressed as one layout
        (:func:`kv_hex.layout.concat_layouts`: the parts' tables concatenated, nothing dequantized) and attended in
        one launch of the fused kernel (:func:`kv_hex.kernels.dispatch.part_attention`: codes dequantized in
        registers, overlay values and full-precision rows read where they are held, one online softmax, GQA). On CPU
        each part (and each stack, of at most 2,048 slots) is read in place as per-head blocks
        (:func:`kv_hex.segment_attention.segment_attention`: only that part's codes are dequantized), and the
        results are merged by log-sum-exp (:func:`kvcore.merge_attention`): the whole dequantized cache never exists
        at once. Each residual entry's attention probability (summed over the queries and its GQA group) is then
        added to the heavy-hitter accumulator (and every entry's, in full mode; HEX §3.3)."""
        if self._shape is None:
            raise ValueError("attend() on an empty store: write() or append() first")
        B, H, D = self._shape
        q = check_query(query, H, D, B)
        scale = check_scale(scale, D)
        device = self._res["pos"].device
        q = q.to(device)
        Hq, Q = q.shape[1], q.shape[2]
        n_parts = len(self._segments) + 1
        held = [i for i, s in enumerate(self._segments) if s.num_entries]
        if self._res["pos"].numel():
            held.append(n_parts - 1)
        if not held:
            out = torch.zeros(B, Hq, Q, D, device=device)
            return out, torch.full((B, Hq, Q), float("-inf"), device=device)
        full_mode = self.config.mode == "full"
        fused = dispatch.use_triton(q)
        # per held part: (out, lse) and, where its sums are accumulated, its entries' logits (entry order);
        # logits only where the accumulator takes them (the residual; every part in full mode)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits: dict[int, torch.Tensor] = {}
        # decode blocks of one size attended as one stack: operations that do not grow with the blocks (on CPU at
        # most _STACK_TOKENS slots a stack, the temporaries it dequantizes)
        segments = [i for i in held if i < n_parts - 1]
        if fused:
            # the first segment (the prompt's) is always attended with the residual, in the launch it had before
            # decode blocks existed: a residual-only launch would compile new kernel variants (no overlay, a tile
            # count that follows the residual's length); a lone decode block is a stack of one (its own launch, so
            # the prompt's segment and the residual keep the uniform path)
            stacks, rest = self._stacks(segments[1:], None, least=1)
            rest = segments[:1] + rest
        else:
            stacks, rest = self._stacks(segments, _STACK_TOKENS)
        # uniform sources of the fused path (kv_hex.uniform): attended by one kernel launch each, one merge
        calls: list[UniformCall] = []
        owners: list[list[int]] = []  # the held parts of each call (segment indices; n_parts - 1: the residual)
        for idx in stacks:
            up = uniform_part(self.config, self._stack(idx)) if fused else None
            if up is not None:
                calls.append(UniformCall(up, stack=len(idx), seg_logits=full_mode))
                owners.append(idx)
                continue
            segs = [self._segments[i] for i in idx]
            out, lse, lg = segments_attention(q, self.config, segs, scale, full_mode, self._stack(idx))
            parts.append((out, lse))
            if lg is not None:
                logits.update(zip(idx, lg))
        if held[-1] == n_parts - 1:
            rest.append(n_parts - 1)
        # the prompt's segment and the residual addressed by arithmetic when both are uniform
        uniform = None
        if fused and rest and rest[0] == 0 and len(rest) <= 2 and (len(rest) == 1 or rest[1] == n_parts - 1):
            TR = self._residual_T()
            uniform = uniform_part(self.config, self._segments[0]) if TR != _RAGGED else None
        if uniform is not None:
            S = B * H
            rk = self._res["k"].view(S, TR, D) if TR else None
            rv = self._res["v"].view(S, TR, D) if TR else None
            calls.append(UniformCall(uniform, rk, rv, seg_logits=full_mode, res_logits=True))
            owners.append([0, n_parts - 1] if TR else [0])
        if calls:
            out, lse, lgs = dispatch.uniform_attention(q, calls, scale)
            parts.append((out, lse))
            for own, (slg, rlg) in zip(owners, lgs):
                if slg is not None:
                    sizes = [self._segments[i].num_entries for i in own if i < n_parts - 1]
                    logits.update(zip(own, slg.split(sizes)))
                if rlg is not None and own[-1] == n_parts - 1:
                    logits[n_parts - 1] = rlg
        if uniform is None and fused and rest:
            # the other parts in one launch and one softmax (the kernel dequantizes in registers; the longest
            # head's length bounded by the parts' own, on the host)
            layouts = self._layouts(bound=True, which=rest)
            part, order = concat_layouts(layouts, sum(p.T for p in layouts))
            out, lse, lg = dispatch.part_attention(q, part, scale, True)
            lg = torch.empty_like(lg).index_copy_(0, order, lg)  # back to the parts' own entry order
            parts.append((out, lse))
            logits.update(zip(rest, lg.split([p.num_entries for p in layouts])))
        elif not fused and rest:
            # one part at a time, read in place
            for i in rest:
                if i < n_parts - 1:
                    out, lse, lg = segment_attention(q, self.config, self._segments[i], scale, full_mode)
                else:
                    out, lse, lg = residual_attention(q, self._res, B, H, self.config.bits, scale, True)
                parts.append((out, lse))
                if lg is not None:
                    logits[i] = lg
        out, lse = merge_attention(parts) if len(parts) > 1 else parts[0]
        rows_lse = lse.reshape(B * H, (Hq // H) * Q)
        accs: dict[int, torch.Tensor] = {}  # part -> its accumulator after this step
        # entries per head of the parts the uniform path attended (their logits are [S, T, R] blocks)
        per_head = {} if uniform is None else {0: uniform.n, n_parts - 1: TR}
        for i, lg in logits.items():
            if i < n_parts - 1 and not full_mode:
                continue  # append mode accumulates into the residual only
            held_acc = self._segments[i].acc if i < n_parts - 1 else self._res["acc"]
            if i in per_head:  # one launch on CUDA (kv_hex.kernels.triton_accumulate)
                accs[i] = dispatch.accumulate_attention(held_acc, lg.view(B * H, per_head[i], -1), rows_lse)
                continue
            seg = self._segments[i].seg() if i < n_parts - 1 else segment_ids(self._res["counts"], lg.shape[0])
            add = torch.exp(lg - rows_lse[seg]).nan_to_num_(0.0).sum(-1)
            accs[i] = add if held_acc is None else held_acc + add
        for i, acc in accs.items():
            if i < n_parts - 1:
                self._segments[i].acc = acc
            else:
                self._res["acc"] = acc
        return out, lse

    # -- bookkeeping -----------------------------------------------------------------------------------
    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes of every tensor this store holds (codes, scales, zeros, full rows, overlay values, positions,
        residual, accumulators). The expander index tables are regenerated from ``(n, d, ρ, seed)`` and shared by
        every layer: not held here (see :meth:`memory_report`)."""
        return reachable_bytes(self, device)

    def seq_lengths(self) -> torch.Tensor:
        """``[B, H]`` entries held per head."""
        if self._shape is None:
            return torch.zeros(0, 0, dtype=torch.long)
        B, H, _ = self._shape
        total = self._res["counts"].clone()
        for s in self._segments:
            total = total + s.counts
        return total.view(B, H)

    def residual_lengths(self) -> torch.Tensor:
        """``[B, H]`` entries waiting in the fp16 residual (fewer than ``block_size`` after every call)."""
        if self._shape is None:
            return torch.zeros(0, 0, dtype=torch.long)
        return self._res["counts"].view(*self._shape[:2]).clone()

    def memory_report(self) -> dict[str, float]:
        """Bytes held and the fraction of an fp16 cache of the same entries.

        Returns ``{"nbytes", "fp16_bytes", "fraction_of_fp16", "payload_fraction_of_fp16", "mask_table_bytes"}``:
        ``fp16_bytes = 2 (K, V) · entries · D · 2``; ``payload`` leaves out the int32 positions and per-segment
        counts (what the paper's figures seem to count, spec A11); ``mask_table_bytes`` are the shared index tables
        of this store's segments (int16, not held per layer).
        """
        if self._shape is None:
            return {"nbytes": 0, "fp16_bytes": 0, "fraction_of_fp16": math.nan}
        from kv_hex.expander import mask_table

        D = self._shape[2]
        entries = int(self.seq_lengths().sum())
        fp16 = 2 * entries * D * 2
        total = self.nbytes()
        meta = sum(
            s.pos.numel() * s.pos.element_size() + s.counts.numel() * 8 + s.slot_pos.numel() * s.slot_pos.element_size()
            for s in self._segments
        )
        meta += self._res["pos"].numel() * self._res["pos"].element_size() + self._res["counts"].numel() * 8
        C = self._shape[1] * D if self.config.mask_scope == "layer" else D
        tables = 0
        for s in self._segments:
            if s.coded:
                t = mask_table(self.config.mask_kind, s.n, C, self.config.rho, self.config.seed)
                tables += 0 if t is None else t.nbytes
        return {
            "nbytes": total,
            "fp16_bytes": fp16,
            "fraction_of_fp16": total / fp16 if fp16 else math.nan,
            "payload_fraction_of_fp16": (total - meta) / fp16 if fp16 else math.nan,
            "mask_table_bytes": tables,
        }

    def crop(self, position: int) -> None:
        """Drop every entry whose true position is ``>= position`` (kept entries' bytes untouched)."""
        check_int("position", position)
        if self._shape is None:
            return
        pos = torch.cat([p for _, p in self._parts()])
        segments, res = self._keep_parts(pos < position)
        self._commit(segments, res)

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` of the batch becomes old row ``index[i]`` (beam search; rows may repeat or vanish)."""
        if self._shape is None:
            return
        B, H, D = self._shape
        rows = check_batch_index("index", index, B).to(self._res["pos"].device)
        segments, res = self._keep_parts(None, rows)
        self._shape = (rows.numel(), H, D)
        try:
            self._commit(segments, res)
        except Exception:  # pragma: no cover - commit cannot fail after validation
            self._shape = (B, H, D)
            raise
