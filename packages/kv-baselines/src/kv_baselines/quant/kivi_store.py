"""KIVI's quantized KV cache as a ``kvcore.Store``: per-channel keys, per-token values, full-precision residuals."""

from __future__ import annotations

import itertools
import math
import warnings

import torch

from kv_baselines.quant.kivi_decode import DecodeState, eligible
from kv_baselines.quant.kivi_layout import Positions, Side, uniform
from kv_baselines.quant.kivi_selector import kivi_tiers
from kvcodec import CodeRows, QuantizedSegment, UniformQuantizer, quantized_attention
from kvcodec.kernels.dispatch import use_triton
from kvcodec.segments import offsets_in_segment, segment_ids
from kvcore import (
    EVICT,
    FULL,
    KVView,
    Plan,
    Quantizer,
    Store,
    check_retier_plan,
    check_write_plan,
    reachable_bytes,
    reference_attention,
)
from kvcore.attention import check_query, check_scale
from kvcore.checks import (
    MAX_POSITION,
    check_append,
    check_batch_index,
    check_finite,
    check_int,
    check_kv,
    check_positions,
    values_checked,
)


class KIVIUnquantizedWarning(UserWarning):
    """A ``KIVIStore.write`` plan keeps more entries than the residual but quantizes none of them."""


def _append_positions(positions: object, shape: tuple[int, int], last: torch.Tensor | None) -> torch.Tensor:
    """:func:`kvcore.checks.check_positions` for appended positions (every entry kept), int64: read on the host for
    the few positions of a CPU decode step, otherwise with one host sync when they are valid (the decode hot path);
    invalid ones get ``check_positions``' own error."""
    if (
        isinstance(positions, torch.Tensor)
        and positions.dtype in (torch.int32, torch.int64)
        and tuple(positions.shape) == tuple(shape)
        and shape[1] > 0
    ):
        p = positions.long()
        if p.device.type == "cpu" and p.numel() <= 64:
            rows = p.tolist()
            prev = [-1] * len(rows) if last is None else last.tolist()
            if all(
                r[0] > before and r[-1] <= MAX_POSITION and all(a < b for a, b in itertools.pairwise(r))
                for r, before in zip(rows, prev)
            ):
                return p
        else:
            bad = ((p < 0) | (p > MAX_POSITION)).any()
            if shape[1] > 1:
                bad = bad | (p[:, 1:] <= p[:, :-1]).any()
            if last is not None:
                bad = bad | (p[:, 0] <= last.to(p.device)).any()
            if not bool(bad):
                return p
    return check_positions("positions", positions, shape, after=last)


def _finite(keys: torch.Tensor, values: torch.Tensor) -> None:
    """Raise :func:`kvcore.checks.check_finite`'s error for non-finite keys or values. One reduction per tensor: a
    non-finite entry makes the sum non-finite (a finite sum clears both); only a non-finite sum (which overflow
    can also give) runs the element-wise check."""
    if not math.isfinite(float(keys.sum(dtype=torch.float32)) + float(values.sum(dtype=torch.float32))):
        check_finite("keys", keys)
        check_finite("values", values)


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
    are then residual). The store also carries that layout as its tier policy (:class:`kvcore.TierPolicy`):
    :meth:`apply_tiers` lays the entries any plan keeps out the same way, and :class:`kvcore.Compressor` applies it
    when its selector only keeps or evicts (``TopKSelector``), so ``Compressor(..., TopKSelector(), KIVIStore)``
    holds what ``kivi(bits, evict=...)`` holds.

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
    reads the held codes directly (the Triton kernel of :func:`kvcodec.quantized_attention` on CUDA; on CPU a
    word-wise unpack into a per-step scratch buffer dequantized in place, see :meth:`attend`) and equals
    ``kvcore.reference_attention(self.read(), query, scale)`` within float tolerance.

    Memory layout (:mod:`kv_baselines.quant.kivi_layout`): flat, segment-major, exact-size tensors per side (packed
    codes, one parameter row per group, full-precision rows) with ``O(B*H)`` counts, and one true position per entry
    shared by keys and values in the narrowest safe integer dtype (int16 below position 32768). Held bytes are the
    packed size (codes + scales + zeros + residual) plus those positions: within 3% of it for SmolLM2's fp32 cache
    at 2k tokens. While a float32 CPU cache decodes with every head holding the same entries (KIVI without eviction),
    ``append`` moves it to the decode layout (:mod:`kv_baselines.quant.kivi_decode`): strided buffers with a bounded
    reserve, counted in ``nbytes()`` and still within 3% of the packed size, that a decode step writes in place and
    ``attend`` unpacks with one vectorised pass per side. Any other operation turns it back into the flat layout
    first (the same entries, bit for bit).

    Every mutation (``write``, ``append``, ``retier``, ``crop``, ``reorder``) is all-or-nothing: arguments are
    validated first (finite entries, positions as :func:`kvcore.checks.check_positions`), then the new state is built
    as new immutable sides (:class:`~kv_baselines.quant.kivi_layout.Side`, sharing every tensor that did not change,
    so nothing is copied for the transaction's sake) and committed last, so a call that raises -- e.g.
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
        check_int("residual", residual, low=1)
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
    def _layout(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(seg [N], flat index into [S, T] [N], T)`` of the held entries (segment-major, position order)."""
        count = self._pos.count
        T = int(count.max()) if count.numel() else 0
        seg = segment_ids(count)
        return seg, seg * T + offsets_in_segment(count), T

    def _prefix(self, side: Side) -> torch.Tensor:
        """``[N]`` bool: the held entries in ``side``'s prefix (not in its residual)."""
        count = self._pos.count
        return offsets_in_segment(count) < (count - side.rcount)[segment_ids(count)]

    def tiers(self) -> Plan:
        """The tier of every held entry (``FULL`` or the quantizer's bits), laid out like :meth:`read`."""
        if self._shape is None:
            raise ValueError("tiers() on an empty store: write() or append() first")
        B, H, _ = self._shape
        S = B * H
        _, idx, T = self._layout()
        out = []
        for kind in ("k", "v"):
            side = self._sides[kind]
            prefix = self._prefix(side)
            tier = torch.full((idx.numel(),), FULL, dtype=torch.uint8, device=idx.device)
            pt = torch.full((int(prefix.sum()),), side.quantizer.bits, dtype=torch.uint8, device=idx.device)
            pt[side.prefix_full()] = FULL
            tier[prefix] = pt
            bits = torch.zeros(S * T, dtype=torch.uint8, device=idx.device)
            bits[idx] = tier
            out.append(bits.view(B, H, T))
        return Plan(out[0], out[1])

    def retier(self, plan: Plan) -> None:
        """Evict the entries ``plan`` marks ``EVICT`` (laid out like :meth:`read`); every other entry keeps its tier
        and its bytes. Raises ``ValueError`` (changing nothing) for another tier, padding kept, or different kept
        sets for keys and values."""
        if self._shape is None:
            raise ValueError("retier() on an empty store: write() or append() first")
        kb, _ = check_retier_plan(plan, self.tiers(), "KIVIStore", eviction_only=True, same_kept=True)
        _, idx, _ = self._layout()
        self._keep((kb != EVICT).flatten()[idx])

    def _keep(self, keep: torch.Tensor) -> None:
        """Keep the held entries where ``keep [N]`` (segment-major); commits."""
        count = self._pos.count
        sides = {kind: side.keep(keep, count) for kind, side in self._sides.items()}
        self._commit(sides, self._pos.keep(keep))

    # -- transactions ----------------------------------------------------------------------------------
    def _commit(self, sides: dict[str, Side], pos: Positions, shape=None, last: torch.Tensor | None = None) -> None:
        """Make the new ``sides``/``pos`` (and ``shape``) the held state: the last step of every mutation, reached
        only when everything before it succeeded, so a failing call leaves ``read()`` and ``nbytes()`` unchanged.
        (Sides are immutable: the new state shares every tensor the mutation did not change.)"""
        B, H, D = self._shape if shape is None else shape
        if last is None:
            last = pos.last().view(B, H).amax(1) if B * H else torch.full((B,), -1, dtype=torch.long)
        self._fs, self._fp, self._dec, self._shape, self._last_pos = sides, pos, None, (B, H, D), last

    # -- representations -------------------------------------------------------------------------------
    @property
    def _sides(self) -> dict[str, Side]:
        """The flat sides (turning a decode-layout state back into them first)."""
        self._flat()
        return self._fs

    @property
    def _pos(self) -> Positions | None:
        """The flat positions (turning a decode-layout state back into them first)."""
        self._flat()
        return self._fp

    def _flat(self) -> None:
        """Hold the state in the flat layout (:mod:`~kv_baselines.quant.kivi_layout`): every operation but
        ``append``, ``attend``, ``nbytes``, ``seq_lengths`` and ``entry_counts`` works on it. The same entries, bit
        for bit; only the decode layout's reserve is given back."""
        if self._dec is not None:
            self._fs, self._fp = self._dec.to_flat()
            self._dec = None

    # -- fused attention -------------------------------------------------------------------------------
    def _dense(self, kind: str, rows_q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[S, T, D]`` the held ``kind`` entries in position order (zeros on padding), quantized rows ``rows_q``."""
        side = self._sides[kind]
        _, idx, T = self._layout()
        S, D = self._pos.count.numel(), self._shape[2]
        out = torch.zeros(S * T, D, dtype=dtype, device=idx.device)
        prefix = self._prefix(side)
        pidx = idx[prefix]
        if not bool(side.fcount.any()):
            out[pidx] = rows_q.to(dtype)
        else:
            fm = side.prefix_full()
            out[pidx[~fm]] = rows_q.to(dtype)
            out[pidx[fm]] = side.full.to(dtype)
        out[idx[~prefix]] = side.resid.to(dtype)
        return out.view(S, T, D)

    def quantized_segment(self) -> QuantizedSegment | None:
        """The held cache as a :class:`kvcodec.QuantizedSegment` laid out like :meth:`read` (``None`` when a
        quantizer is not a ``kvcodec.UniformQuantizer``): the input of the fused Triton decode kernel."""
        if self._shape is None:
            raise ValueError("quantized_segment() on an empty store: write() or append() first")
        B, H, D = self._shape
        S = B * H
        _, idx, T = self._layout()
        dev = idx.device
        maps = []
        for kind in ("k", "v"):
            side = self._sides[kind]
            q = side.quantizer
            if not isinstance(q, UniformQuantizer):
                return None
            C = D if q.axis == "channel" else -(-D // q.group_size)
            if side.scales is None:
                scales = zeros = torch.zeros(0, C, dtype=self._dtype, device=dev)
            else:
                scales, zeros = side.scales.flatten(1), side.zeros.flatten(1)
            Nq, Nf = side.codes.shape[0], side.full.shape[0]
            codes = CodeRows(
                side.codes, scales, zeros, q.bits, q.axis, q.group_size, torch.cat([side.full, side.resid])
            )
            prefix = self._prefix(side)
            fm = side.prefix_full()
            entry_row = torch.empty(idx.numel(), dtype=torch.long, device=dev)
            entry_group = torch.zeros(idx.numel(), dtype=torch.long, device=dev)
            prow = torch.empty(fm.numel(), dtype=torch.long, device=dev)
            prow[~fm] = torch.arange(Nq, device=dev)
            prow[fm] = -1 - torch.arange(Nf, device=dev)
            pgroup = torch.zeros(fm.numel(), dtype=torch.long, device=dev)
            pgroup[~fm] = side.unit_of_row()
            entry_row[prefix], entry_group[prefix] = prow, pgroup
            entry_row[~prefix] = -1 - Nf - torch.arange(side.resid.shape[0], device=dev)
            row = torch.zeros(S * T, dtype=torch.long, device=dev)
            group = torch.zeros(S * T, dtype=torch.long, device=dev)
            row[idx], group[idx] = entry_row, entry_group
            maps.append((codes, row.view(B, H, T), group.view(B, H, T)))
        bias = torch.full((S * T,), float("-inf"), device=dev)
        bias[idx] = 0.0
        (ks, kr, kg), (vs, vr, vg) = maps
        return QuantizedSegment(ks, vs, kr, kg, vr, vg, bias.view(B, H, T))

    def _fast(self) -> bool:
        """Whether the decode fast path applies: uniform quantizers, no permanent full-precision entries and the same
        number of entries (and of residual entries, per side) in every segment."""
        return all(
            isinstance(side.quantizer, UniformQuantizer)
            and not bool(side.fcount.any())
            and uniform(side.rcount)
            and uniform(side.qcount)
            for side in self._sides.values()
        ) and uniform(self._pos.count)

    def attend(self, query: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query [B, Hq, Q, D]`` over the held cache, read from the codes.

        Returns ``(out fp32 [B, Hq, Q, D], lse fp32 [B, Hq, Q])``, equal to
        ``kvcore.reference_attention(self.read(), query, scale)`` within float tolerance. With uniform quantizers
        and equal-length heads (KIVI's decode) the codes of each side are unpacked by 32-bit words into one scratch
        buffer per step, dequantized in place (a multiply and an add) and multiplied in one batched matmul, and the
        logits over the quantized part and over the residual are computed
        separately (no concatenated or position-sorted copy of the cache); otherwise the cache is laid out densely
        (padding masked) first. Non-uniform quantizers attend over :meth:`read`.
        """
        if self._shape is None:
            raise ValueError("attend() on an empty store: write() or append() first")
        B, H, D = self._shape
        q = check_query(query, H, D, B)
        scale = check_scale(scale, D)
        if self._dec is not None:
            Hq, Q = q.shape[1], q.shape[2]
            qd = q.to(self._dec.kc.device).reshape(B, H, Hq // H * Q, D).reshape(B * H, -1, D)
            out, lse = self._dec.attend(qd, scale)
            return out.view(B, Hq, Q, D), lse.view(B, Hq, Q)
        ks, vs = self._sides["k"], self._sides["v"]
        if not (isinstance(ks.quantizer, UniformQuantizer) and isinstance(vs.quantizer, UniformQuantizer)):
            return reference_attention(self.read(), q, scale)
        dev = ks.resid.device
        if use_triton(ks.resid):  # the fused Triton kernel over the codes (kvcodec.quantized_attention)
            return quantized_attention(q.to(dev), self.quantized_segment(), scale)
        S = B * H
        Hq, Q = q.shape[1], q.shape[2]
        qf = q.to(dev).float().reshape(B, H, Hq // H * Q, D).reshape(S, -1, D)
        if self._fast():
            kr, vr = ks.resid.float().view(S, -1, D), vs.resid.float().view(S, -1, D)
            logits = torch.cat([ks.logits(qf, S), qf @ kr.transpose(1, 2)], -1) * scale
            lse = torch.logsumexp(logits, -1, keepdim=True)
            p = torch.exp(logits - lse)
            tq = vs.codes.shape[0] // S if S else 0
            out = vs.weighted(p[..., :tq], S) + p[..., tq:] @ vr
            return out.view(B, Hq, Q, D), lse.view(B, Hq, Q)
        k = self._dense("k", ks.dequantized_fast(), torch.float32)
        v = self._dense("v", vs.dequantized_fast(), torch.float32)
        _, idx, T = self._layout()
        bias = torch.full((S * T,), float("-inf"), device=dev)
        bias[idx] = 0.0
        logits = (qf @ k.transpose(1, 2)) * scale + bias.view(S, 1, T)
        lse = torch.logsumexp(logits, -1, keepdim=True)
        safe = torch.where(torch.isfinite(lse), lse, 0.0)
        out = torch.exp(logits - safe) @ v
        return out.view(B, Hq, Q, D), lse.view(B, Hq, Q)

    def reset(self) -> None:
        """Drop everything and free the memory."""
        self._shape: tuple[int, int, int] | None = None  # (B, H, D)
        self._dtype: torch.dtype | None = None
        self._last_pos: torch.Tensor | None = None  # [B] largest position held per batch row (-1: none)
        self._fs: dict[str, Side] = {}  # the flat layout (kivi_layout), or
        self._fp: Positions | None = None
        self._dec: DecodeState | None = None  # the decode layout (kivi_decode) while decoding

    def _empty(self, S: int, D: int, dtype: torch.dtype, device: torch.device) -> dict[str, Side]:
        return {
            kind: Side.empty(q, self._unit(q), S, D, dtype, device)
            for kind, q in (("k", self.key_quantizer), ("v", self.value_quantizer))
        }

    @staticmethod
    def _unit(q: Quantizer) -> int:
        return q.group_size if q.axis == "channel" else 1

    # -- checks ----------------------------------------------------------------------------------------
    def _check_kv(self, keys: torch.Tensor, values: torch.Tensor, *, held: bool) -> None:
        """Float ``[B, H, T, D]`` keys and values of one dtype, shape and device; with ``held``, matching the held
        cache."""
        check_kv(keys, values, held=(*self._shape, self._dtype) if held and self._shape is not None else None)

    # -- protocol --------------------------------------------------------------------------------------
    def apply_tiers(self, plan: Plan) -> Plan:
        """KIVI's prefill layout over the entries ``plan`` keeps (:class:`kvcore.TierPolicy`).

        Per head, among the kept entries in token order: keys -- the last ``n mod residual`` ``FULL``, the rest at
        the key quantizer's bits; values -- the last ``min(n, residual)`` ``FULL``, the rest at the value quantizer's
        bits (Liu et al. 2024, "KIVI", Alg. 1; :func:`~kv_baselines.quant.kivi_tiers`, the layout
        :class:`~kv_baselines.quant.KIVITierSelector` produces). ``plan``'s own tiers are ignored: only kept vs
        evicted counts. Its element-level ``full_precision`` mask is passed on (``write`` refuses it).
        """
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a kvcore.Plan, got {type(plan).__name__}")
        return Plan(
            kivi_tiers(plan.keep_keys, self.key_quantizer.bits, self.residual, "keys"),
            kivi_tiers(plan.keep_values, self.value_quantizer.bits, self.residual, "values"),
            plan.full_precision,
        )

    def write(self, keys: torch.Tensor, values: torch.Tensor, plan: Plan, positions: torch.Tensor) -> None:
        """Replace the content with ``keys``/``values [B, H, T, D]`` laid out per ``plan`` (see class doc).

        Everything is validated (finite kept entries, positions as :func:`kvcore.checks.check_positions`) and the new
        content built before the held one is replaced: a call that raises leaves the store as it was."""
        self._check_kv(keys, values, held=False)
        B, H, T, D = keys.shape
        kb, vb = check_write_plan(
            plan,
            (B, H, T),
            keys.device,
            "KIVIStore",
            key_tiers={EVICT, FULL, self.key_quantizer.bits},
            value_tiers={EVICT, FULL, self.value_quantizer.bits},
            same_kept=True,
        )
        keep = kb != EVICT
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
                "(it lays kept entries out as KIVI does), write KIVIStore.apply_tiers(plan), or build the "
                "compressor with kv_baselines.kivi(bits, evict=<an evicting Compressor>).",
                KIVIUnquantizedWarning,
                stacklevel=2,
            )
        sides = {}
        for kind, x, bits, q in (("k", keys, kb, self.key_quantizer), ("v", values, vb, self.value_quantizer)):
            quant, resid, full = self._roles(bits, q.bits, kind)
            sides[kind] = Side.build(q, self._unit(q), x, quant, full, resid)
        pos = Positions.of(positions[:, None, :].expand(B, H, T)[keep], keep.sum(-1).flatten())
        self.reset()
        self._dtype = keys.dtype
        self._commit(sides, pos, (B, H, D))

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
        the residual flushes build new sides, so a failing quantization leaves the store unchanged. Inputs are
        validated once here; a ``UniformQuantizer`` value FIFO flush then goes through
        :func:`kv_baselines.quant.token_quant.quantize_tokens` (the same codes, scales and zeros as
        ``UniformQuantizer.quantize``, without its per-call checks and ``QuantizedTensor`` construction)."""
        self._check_kv(keys, values, held=True)
        B, H, n, D = keys.shape
        last = None if self._shape is None else self._last_pos
        if values_checked(keys):
            positions = _append_positions(positions, (B, n), last).to(keys.device)
            _finite(keys, values)
        else:  # an accelerator's hot path: shapes and dtypes only (kvcore.checks, "Value checks on accelerators")
            positions = check_append(keys, values, positions, last)
        S = B * H
        if self._shape is not None:
            dec = self._dec
            if dec is None and eligible(self._fs, self._fp, B, H, self.residual):
                dec = DecodeState.of(self._fs, self._fp, B, H, self.residual)
            if dec is not None:  # the decode layout: written in place (all-or-nothing inside)
                dec.append(keys, values, positions)
                self._dec, self._fs, self._fp = dec, {}, None
                self._last_pos = positions[:, -1]
                return
        if self._shape is None:
            sides, held = (
                self._empty(S, D, keys.dtype, keys.device),
                Positions.of(
                    torch.zeros(0, dtype=torch.long, device=keys.device),
                    torch.zeros(S, dtype=torch.long, device=keys.device),
                ),
            )
        else:
            sides, held = self._sides, self._pos
        R = self.residual
        # keys: grow the residual to R, then quantize whole blocks of R per channel
        ks = sides["k"].push(keys.reshape(S, n, D))
        while max(ks.rcount.tolist(), default=0) >= R:
            ks = ks.flush(torch.where(ks.rcount >= R, R, 0))
        # values: FIFO of R, the oldest overflow is quantized per token
        vs = sides["v"].push(values.reshape(S, n, D))
        if max(vs.rcount.tolist(), default=0) > R:
            vs = vs.flush((vs.rcount - R).clamp_min(0))
        pos = held.append(positions[:, None, :].expand(B, H, n).reshape(S, n))
        self._dtype = keys.dtype
        self._commit({"k": ks, "v": vs}, pos, (B, H, D), last=positions[:, -1] if n else None)

    def read(self, query: torch.Tensor | None = None) -> KVView:
        """Dequantized, position-ordered view; heads padded with ``-inf`` bias and position ``-1``."""
        if self._shape is None:
            raise ValueError("read() on an empty store: write() or append() first")
        B, H, D = self._shape
        S = B * H
        k = self._dense("k", self._sides["k"].dequantized(), self._dtype)
        v = self._dense("v", self._sides["v"].dequantized(), self._dtype)
        _, idx, T = self._layout()
        positions = torch.full((S * T,), -1, dtype=torch.long, device=idx.device)
        positions[idx] = self._pos.flat()
        positions = positions.view(B, H, T)
        bias = torch.zeros(B, H, T, device=idx.device).masked_fill(positions < 0, float("-inf"))
        return KVView(k.view(B, H, T, D), v.view(B, H, T, D), positions, bias)

    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes of every tensor this store holds (codes, scales, zeros, residuals, positions, indices)."""
        return reachable_bytes(self, device)

    def seq_lengths(self) -> torch.Tensor:
        """``[B, H]`` entries held per head."""
        if self._shape is None:
            return torch.zeros(0, 0, dtype=torch.long)
        B, H, _ = self._shape
        if self._dec is not None:
            return torch.full((B, H), self._dec.length, dtype=torch.long)
        return self._pos.count.view(B, H).clone()

    def entry_counts(self) -> dict[str, torch.Tensor]:
        """``[B, H]`` entries per tier: ``keys_quantized``, ``keys_full``, ``keys_residual`` and the same for values.

        ``*_full`` counts every full-precision entry (the residual included); ``*_residual`` the residual only.
        """
        if self._shape is None:
            return {}
        B, H, _ = self._shape
        out = {}
        if self._dec is not None:
            c = self._dec.counts()
            for name, q, r in (("keys", c["kq"], c["kr"]), ("values", c["vq"], c["vr"])):
                out[f"{name}_quantized"] = torch.full((B, H), q, dtype=torch.long)
                out[f"{name}_residual"] = torch.full((B, H), r, dtype=torch.long)
                out[f"{name}_full"] = torch.full((B, H), r, dtype=torch.long)
            return out
        for kind, name in (("k", "keys"), ("v", "values")):
            side = self._sides[kind]
            out[f"{name}_quantized"] = side.qcount.view(B, H).clone()
            out[f"{name}_residual"] = side.rcount.view(B, H).clone()
            out[f"{name}_full"] = (side.fcount + side.rcount).view(B, H)
        return out

    def crop(self, position: int) -> None:
        """Drop every entry whose true position is ``>= position``.

        A per-channel key group cut by ``position`` keeps its scale and zero and drops the code rows past the cut
        (nothing is re-quantized); groups left without entries are freed.
        """
        check_int("position", position)
        if self._shape is None:
            return
        self._keep(self._pos.flat() < position)

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` of the batch becomes old row ``index[i]`` (beam search; rows may repeat or vanish)."""
        if self._shape is None:
            return
        B, H, D = self._shape
        index = check_batch_index("index", index, B)
        device = self._pos.count.device
        take = (index.to(device)[:, None] * H + torch.arange(H, device=device)).flatten()
        count = self._pos.count
        sides = {kind: side.take_segments(take, count) for kind, side in self._sides.items()}
        self._commit(sides, self._pos.take(take), (index.numel(), H, D))
