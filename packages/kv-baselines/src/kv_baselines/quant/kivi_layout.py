"""The memory layout of one side (keys or values) of a :class:`~kv_baselines.quant.KIVIStore`.

Every tensor is *flat and segment-major*: the entries of segment 0 (batch row 0, KV head 0), then segment 1, ...,
each segment's entries in position order, with a per-segment count ``[S]`` beside it. Nothing is padded and no
capacity is reserved, so the bytes held are the codes, the group parameters and the full-precision rows plus
``O(S)`` counts (KIVI §3.3-3.4 layout; Liu et al. 2024). When every segment holds the same number of entries
(KIVI without eviction, the common decode case) a flat tensor *is* the dense ``[S, T, ...]`` tensor (a view), which
the fused decode attention uses directly.

Per side, a segment's entries in position order are a *prefix* -- quantized entries, possibly interleaved with
entries kept in full precision for good (``full_mask`` says which; ``None`` when the prefix holds only one kind, KIVI's
case) --
followed by the *residual*: the last ``rcount[s]`` entries, full precision, which the residual policy moves to the
quantized part oldest first. Quantized entries are cut into *units* of ``unit`` consecutive entries (one
per-channel group of ``G`` tokens for keys, one token for values); each unit holds one parameter row and never gets
re-quantized; an evicted entry drops its code row and leaves its unit's parameters as they were.

Every operation returns a new :class:`Side` and never writes into a tensor the old one uses, so a store can build
the new state of both sides and commit it last (all-or-nothing mutations) without copying what did not change.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kv_baselines.quant.token_quant import quantize_tokens
from kvcodec import UniformQuantizer
from kvcodec.narrow import narrow_int
from kvcodec.packing import unpack_unchecked
from kvcodec.segments import exclusive_cumsum, offsets_in_segment, segment_ids, segment_take
from kvcore import QuantizedTensor, Quantizer


def uniform(counts: torch.Tensor) -> bool:
    """Whether every segment holds the same number of entries."""
    return len(set(counts.tolist())) <= 1


def interleave(
    old: torch.Tensor, old_counts: torch.Tensor, new: torch.Tensor, new_counts: torch.Tensor
) -> torch.Tensor:
    """Flat rows with each segment's ``new`` rows placed after its ``old`` rows (both segment-major)."""
    S = old_counts.numel()
    if new.shape[0] == 0:
        return old
    if old.shape[0] == 0:
        return new
    if uniform(old_counts) and uniform(new_counts):
        return torch.cat([old.view(S, -1, *old.shape[1:]), new.view(S, -1, *new.shape[1:])], 1).flatten(0, 1)
    out = torch.empty(old.shape[0] + new.shape[0], *old.shape[1:], dtype=old.dtype, device=old.device)
    old_seg, new_seg = segment_ids(old_counts), segment_ids(new_counts)
    out[torch.arange(old.shape[0], device=old.device) + exclusive_cumsum(new_counts)[old_seg]] = old
    out[torch.arange(new.shape[0], device=old.device) + torch.cumsum(old_counts, 0)[new_seg]] = new
    return out


def _mixed(mask: torch.Tensor) -> torch.Tensor | None:
    """``mask`` when it holds both values, else ``None`` (the side's counts say which single kind it is)."""
    return mask if bool(mask.any()) and not bool(mask.all()) else None


def front_mask(counts: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the first ``k[s]`` entries of every segment."""
    return offsets_in_segment(counts) < k[segment_ids(counts)]


@functools.cache
def _lut(bits: int, device: torch.device) -> torch.Tensor:
    """``[256, 8 // bits]`` float32: the codes a packed byte holds (little-endian lanes, kvcodec's layout)."""
    per = 8 // bits
    byte = torch.arange(256, device=device)[:, None]
    return ((byte >> (torch.arange(per, device=device) * bits)) & ((1 << bits) - 1)).float()


@functools.cache
def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """int32 ``[32 // bits]``: the bit offset of every code lane of a little-endian 32-bit word."""
    return torch.arange(32 // bits, dtype=torch.int32, device=device) * bits


def word_aligned(width: int, bits: int) -> bool:
    """Whether packed rows of ``width`` bytes unpack by 32-bit words (:func:`unpack_words`)."""
    return 8 % bits == 0 and width % 4 == 0 and sys.byteorder == "little"


def unpack_words(packed: torch.Tensor, bits: int, dims: tuple[int, ...] = (0,)) -> torch.Tensor:
    """float32 codes of uint8 ``packed [..., W]`` (``W % 4 == 0``, contiguous rows), ``[..., W * 8 // bits]``.

    The rows are read as little-endian 32-bit words and every lane is shifted out and masked in one broadcast op
    (about twice as fast on CPU as a per-byte table lookup). ``dims``: a permutation of the leading dims applied
    to the words before unpacking (the output is laid out in that order, contiguous).
    """
    words = packed.view(torch.int32)
    if dims != tuple(range(len(dims))):
        words = words.permute(*dims, words.ndim - 1).contiguous()  # the small int32 words, not the output
    out = words[..., None] >> _shifts(bits, packed.device)
    out &= (1 << bits) - 1
    return out.float().flatten(-2)


def unpack_float(codes: torch.Tensor, bits: int, D: int) -> torch.Tensor:
    """float32 ``[N, D]`` codes of packed rows ``[N, packed_width(D, bits)]`` (32-bit words or a byte lookup for
    1/2/4/8 bits)."""
    N = codes.shape[0]
    if word_aligned(codes.shape[-1], bits) and codes.is_contiguous():
        out = unpack_words(codes, bits)
        return out if out.shape[1] == D else out[:, :D].contiguous()
    if 8 % bits == 0:
        out = F.embedding(codes.reshape(-1).int(), _lut(bits, codes.device)).view(N, -1)
        return out if out.shape[1] == D else out[:, :D].contiguous()
    return unpack_unchecked(codes, bits, D).float()


class _Params(NamedTuple):
    """The fields of a ``QuantizedTensor`` that :meth:`Side.add_quantized` reads (the specialised value path)."""

    bits: int
    axis: str
    group_size: int
    dtype: torch.dtype
    scales: torch.Tensor
    zeros: torch.Tensor
    codebook: None


@dataclasses.dataclass(frozen=True)
class Side:
    """One side (keys or values) of a KIVI store, in the segment-major layout of the module docstring.

    Attributes
    ----------
    codes : Tensor
        uint8 ``[Nq, PW]`` packed code rows of the quantized entries.
    scales, zeros : Tensor
        ``[Nu, 1, C]`` parameter row of every unit (``zeros`` may be ``None``, ``codebook`` may be set, as the
        quantizer returns them).
    usize : Tensor or None
        int16 ``[Nu]`` entries each unit still holds (``None`` for one-entry units).
    ucount, qcount : Tensor
        int64 ``[S]`` units / quantized entries per segment.
    full, fcount : Tensor
        ``[Nf, D]`` entries kept in full precision for good and ``[S]`` their count per segment; ``full_mask`` bool
        over the prefix entries, ``True`` for those; stored only when the prefix mixes both kinds (``None``
        otherwise), so the bytes held depend on the entries held, not on their history.
    resid, rcount : Tensor
        ``[Nr, D]`` the residual rows and ``[S]`` their count per segment.
    """

    quantizer: Quantizer
    unit: int
    D: int
    dtype: torch.dtype
    codes: torch.Tensor
    scales: torch.Tensor | None
    zeros: torch.Tensor | None
    codebook: torch.Tensor | None
    usize: torch.Tensor | None
    ucount: torch.Tensor
    qcount: torch.Tensor
    full: torch.Tensor
    fcount: torch.Tensor
    full_mask: torch.Tensor | None
    resid: torch.Tensor
    rcount: torch.Tensor
    meta: tuple | None

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def empty(cls, quantizer: Quantizer, unit: int, S: int, D: int, dtype: torch.dtype, device) -> Side:
        zero = torch.zeros(S, dtype=torch.long, device=device)
        rows = torch.zeros(0, D, dtype=dtype, device=device)
        pw = (D * quantizer.bits + 7) // 8
        codes = torch.zeros(0, pw, dtype=torch.uint8, device=device)
        return cls(
            quantizer, unit, D, dtype, codes, None, None, None, None, zero, zero, rows, zero, None, rows, zero, None
        )

    @classmethod
    def build(
        cls,
        quantizer: Quantizer,
        unit: int,
        x: torch.Tensor,
        quant: torch.Tensor,
        full: torch.Tensor,
        resid: torch.Tensor,
    ) -> Side:
        """A side holding the entries of ``x [B, H, T, D]`` under the disjoint masks ``quant``/``full``/``resid``
        ``[B, H, T]`` (the residual entries are the trailing kept entries of each segment)."""
        B, H, _, D = x.shape
        S = B * H
        side = cls.empty(quantizer, unit, S, D, x.dtype, x.device)
        side = side.add_quantized(x[quant], quant.sum(-1).flatten())  # before the full mask: it covers these too
        fm = full[quant | full]
        return dataclasses.replace(
            side,
            full=x[full],
            fcount=full.sum(-1).flatten(),
            full_mask=_mixed(fm),
            resid=x[resid],
            rcount=resid.sum(-1).flatten(),
        )

    # -- derived ---------------------------------------------------------------------------------------
    def prefix_full(self) -> torch.Tensor:
        """``[Np]`` bool over the prefix entries (segment-major): ``True`` for permanent full-precision ones."""
        if self.full_mask is not None:
            return self.full_mask
        n = int(self.qcount.sum() + self.fcount.sum())
        return torch.full((n,), bool(self.fcount.any()), dtype=torch.bool, device=self.qcount.device)

    def pcount(self, count: torch.Tensor) -> torch.Tensor:
        """``[S]`` prefix entries per segment given the store's per-segment ``count``."""
        return count - self.rcount

    def unit_of_row(self) -> torch.Tensor:
        """``[Nq]`` unit index of every quantized row."""
        n = self.codes.shape[0]
        if self.usize is None:
            return torch.arange(n, device=self.codes.device)
        return torch.repeat_interleave(torch.arange(self.usize.numel(), device=self.codes.device), self.usize.long())

    # -- reading ---------------------------------------------------------------------------------------
    def dequantized(self) -> torch.Tensor:
        """``[Nq, D]`` the quantized rows through ``quantizer.dequantize`` (in the cache dtype)."""
        Nq, D, U = self.codes.shape[0], self.D, self.unit
        if Nq == 0:
            return torch.zeros(0, D, dtype=self.dtype, device=self.codes.device)
        bits, axis, group_size, _, dtype = self.meta
        Nu = self.ucount.sum().item() if self.scales is None else self.scales.shape[0]
        if U == 1:
            codes, cell = self.codes.view(Nq, 1, -1), None
        else:
            uid = self.unit_of_row()
            cell = uid * U + offsets_in_segment(self.usize.long())
            codes = torch.zeros(Nu * U, self.codes.shape[1], dtype=torch.uint8, device=self.codes.device)
            codes[cell] = self.codes
            codes = codes.view(Nu, U, -1)
        q = QuantizedTensor(
            codes=codes,
            scales=self.scales,
            zeros=self.zeros,
            bits=bits,
            axis=axis,
            group_size=group_size,
            shape=(Nu, U, D),
            dtype=dtype,
            codebook=self.codebook,
        )
        y = self.quantizer.dequantize(q).reshape(Nu * U, D)
        return y if cell is None else y[cell]

    def dequantized_fast(self) -> torch.Tensor:
        """float32 ``[Nq, D]``: the quantized rows of a :class:`kvcodec.UniformQuantizer` as the cache reads them
        back (``zero + code * scale`` in float32, rounded to the cache dtype), from a byte lookup and one fused
        multiply-add over every row (no per-row gathers when every unit is whole)."""
        Nq, D, U = self.codes.shape[0], self.D, self.unit
        dev = self.codes.device
        if Nq == 0:
            return torch.zeros(0, D, device=dev)
        _, axis, G, _, _ = self.meta
        c = unpack_float(self.codes, self.quantizer.bits, D)
        s, z = self.scales.float(), self.zeros.float()  # [Nu, 1, C]
        if axis == "channel":
            if U * s.shape[0] == Nq:  # every unit whole: the rows are [Nu, U, D] as they stand
                y = torch.addcmul(z, c.view(-1, U, D), s).view(Nq, D)
            else:
                uid = self.unit_of_row()
                y = torch.addcmul(z[uid, 0], c, s[uid, 0])
        elif D % G == 0:
            C = D // G
            y = torch.addcmul(z.view(-1, C, 1), c.view(-1, C, G), s.view(-1, C, 1)).view(Nq, D)
        else:
            col = torch.arange(D, device=dev) // G
            y = torch.addcmul(z[:, 0, col], c, s[:, 0, col])
        if self.dtype != torch.float32:
            fmax = torch.finfo(self.dtype).max
            y = y.clamp_(-fmax, fmax).to(self.dtype).float()
        return y

    def _lut_ok(self) -> bool:
        return (
            isinstance(self.quantizer, UniformQuantizer)
            and self.dtype == torch.float32
            and 8 % self.quantizer.bits == 0
            and self.scales is not None
        )

    def logits(self, qf: torch.Tensor, S: int) -> torch.Tensor:
        """``qf [S, M, D] @ k^T`` over the quantized rows (every segment holding ``Nq / S``), float32 ``[S, M, Tq]``.

        Per-channel groups of whole units (float32 caches): the codes are unpacked by 32-bit words into one float
        buffer, dequantized in place (``c * s + z``, two passes) and multiplied in one batched matmul -- no packed
        copy is kept, the buffer is the step's scratch."""
        D, U = self.D, self.unit
        Nq = self.codes.shape[0]
        Tq = Nq // S if S else 0
        if Tq and self._lut_ok() and self.meta[1] == "channel" and U * self.scales.shape[0] == Nq:
            nG = Tq // U
            k = unpack_float(self.codes, self.quantizer.bits, D).view(S, nG, U, D)
            k.mul_(self.scales.view(S, nG, 1, D)).add_(self.zeros.view(S, nG, 1, D))
            return qf @ k.view(S, Tq, D).transpose(1, 2)
        return qf @ self.dequantized_fast().view(S, Tq, D).transpose(1, 2)

    def weighted(self, p: torch.Tensor, S: int) -> torch.Tensor:
        """``p [S, M, Tq] @ v`` over the quantized rows, float32 ``[S, M, D]``.

        Per-token groups of whole bytes (float32 caches): unpacked by 32-bit words (or a byte lookup), dequantized in
        place per ``(token, group)`` and multiplied in one batched matmul. (Folding the scales and zeros into the
        attention rows instead, ``(p * s) @ c + p @ z`` per group, measured slower on CPU: the per-group product is a
        batched matmul over ``B*H*C`` slices with an unpack into group-major order.)"""
        D = self.D
        Nq = self.codes.shape[0]
        Tq = Nq // S if S else 0
        G, bits = self.quantizer.group_size, self.quantizer.bits
        if Tq and self._lut_ok() and self.meta[1] == "token" and D % G == 0 and (G * bits) % 8 == 0:
            C = D // G
            v = unpack_float(self.codes, bits, D).view(S, Tq, C, G)
            v.mul_(self.scales.view(S, Tq, C, 1)).add_(self.zeros.view(S, Tq, C, 1))
            return p @ v.view(S, Tq, D)
        return p @ self.dequantized_fast().view(S, Tq, D)

    # -- editing ---------------------------------------------------------------------------------------
    def add_quantized(self, rows: torch.Tensor, counts: torch.Tensor) -> Side:
        """Quantize ``rows [M, D]`` (``counts[s]`` per segment, segment-major) in whole units of each segment's
        new entries and place them after the segment's quantized entries (and at the end of its prefix)."""
        if rows.shape[0] == 0:
            return self
        U, D = self.unit, self.D
        dev = rows.device
        if U == 1:
            x, real, ucount = rows[:, None], None, counts
        else:
            n_units = -(-counts // U)
            useg = segment_ids(n_units)
            i = offsets_in_segment(n_units)[:, None] * U + torch.arange(U, device=dev)
            cnt = counts[useg][:, None]
            x = rows[exclusive_cumsum(counts)[useg][:, None] + torch.minimum(i, cnt - 1)]
            real, ucount = i < cnt, n_units
        qz = self.quantizer
        if U == 1 and isinstance(qz, UniformQuantizer) and qz.axis == "token":  # values: the specialised path
            codes, scales, zeros = quantize_tokens(rows, qz.bits, qz.group_size)
            if not bool(torch.isfinite(scales).all()):
                raise ValueError(
                    f"x has a group range (max - min) too large for {scales.dtype} scales at bits={qz.bits}; "
                    "quantize it in float32"
                )
            q = _Params(qz.bits, "token", qz.group_size, rows.dtype, scales, zeros, None)
        else:
            q = self.quantizer.quantize(x)
            codes = q.codes.view(-1, q.codes.shape[-1]) if real is None else q.codes[real]
        meta = (q.bits, q.axis, q.group_size, D, q.dtype)
        if self.meta is not None and meta != self.meta:
            raise ValueError(f"quantized units must share (bits, axis, group_size, D, dtype) {self.meta}, got {meta}")
        if tuple(q.scales.shape[1:-1]) != (1,):
            raise ValueError(f"a unit must be one quantization group, got scales {tuple(q.scales.shape)}")
        usize = None if real is None else real.sum(1).to(torch.int16)

        def merge(old, new):
            return new if old is None else interleave(old, self.ucount, new, ucount)

        fm = self.prefix_full() if bool(self.fcount.any()) else None
        if fm is not None:  # the new quantized entries end each segment's prefix
            fm = interleave(
                fm, self.qcount + self.fcount, torch.zeros(codes.shape[0], dtype=torch.bool, device=dev), counts
            )
        return dataclasses.replace(
            self,
            codes=interleave(self.codes, self.qcount, codes, counts),
            scales=merge(self.scales, q.scales),
            zeros=None if q.zeros is None else merge(self.zeros, q.zeros),
            codebook=q.codebook,
            usize=None if usize is None else merge(self.usize, usize),
            ucount=self.ucount + ucount,
            qcount=self.qcount + counts,
            full_mask=None if fm is None else _mixed(fm),
            meta=meta,
        )

    def push(self, rows: torch.Tensor) -> Side:
        """Append ``rows [S, n, D]`` to every segment's residual."""
        S, n, _ = rows.shape
        new_counts = torch.full((S,), n, dtype=torch.long, device=rows.device)
        resid = interleave(self.resid, self.rcount, rows.reshape(S * n, -1).to(self.dtype), new_counts)
        return dataclasses.replace(self, resid=resid, rcount=self.rcount + n)

    def flush(self, k: torch.Tensor) -> Side:
        """Quantize the ``k[s]`` oldest residual entries of every segment."""
        S = k.numel()
        ks, rs = k.tolist(), self.rcount.tolist()
        if len(set(ks)) == 1 and len(set(rs)) == 1 and S:  # every segment alike: slices, no masks
            r = self.resid.view(S, rs[0], -1)
            old, rest = r[:, : ks[0]].reshape(-1, self.D), r[:, ks[0] :].reshape(-1, self.D)
        else:
            taken = front_mask(self.rcount, k)
            old, rest = self.resid[taken], self.resid[~taken]
        side = dataclasses.replace(self, resid=rest, rcount=self.rcount - k)
        return side.add_quantized(old, k)

    def keep(self, keep: torch.Tensor, count: torch.Tensor) -> Side:
        """Keep the entries where ``keep [N]`` (the store's segment-major entries, ``count [S]`` per segment)."""
        S = count.numel()
        seg = segment_ids(count)
        is_prefix = offsets_in_segment(count) < self.pcount(count)[seg]
        kp, kr = keep[is_prefix], keep[~is_prefix]
        fm = self.prefix_full() if bool(self.fcount.any()) else None
        kq = kp if fm is None else kp[~fm]
        rseg = seg[~is_prefix]
        out = dict(resid=self.resid[kr], rcount=torch.bincount(rseg[kr], minlength=S))
        if fm is not None:
            new_fm = fm[kp]
            kf = kp[fm]
            out["full"] = self.full[kf]
            out["fcount"] = torch.bincount(segment_ids(self.fcount)[kf], minlength=S)
            out["full_mask"] = _mixed(new_fm)
        if self.codes.shape[0]:
            uid = self.unit_of_row()
            per_unit = torch.bincount(uid[kq], minlength=self.scales.shape[0])
            kept_units = per_unit > 0
            useg = segment_ids(self.ucount)
            out.update(
                codes=self.codes[kq],
                scales=self.scales[kept_units],
                zeros=None if self.zeros is None else self.zeros[kept_units],
                usize=None if self.usize is None else per_unit[kept_units].to(torch.int16),
                ucount=torch.bincount(useg[kept_units], minlength=S),
                qcount=torch.bincount(segment_ids(self.qcount)[kq], minlength=S),
            )
        side = dataclasses.replace(self, **out)
        return side

    def take_segments(self, take: torch.Tensor, count: torch.Tensor) -> Side:
        """Segment ``i`` becomes old segment ``take[i]`` (segments may repeat or vanish)."""
        S = count.numel()

        def take_rows(t, counts):
            idx, _ = segment_take(segment_ids(counts), take, S)
            return t[idx]

        out = dict(
            resid=take_rows(self.resid, self.rcount),
            rcount=self.rcount[take],
            ucount=self.ucount[take],
            qcount=self.qcount[take],
        )
        if bool(self.fcount.any()):
            out["full"] = take_rows(self.full, self.fcount)
            out["fcount"] = self.fcount[take]
        if self.full_mask is not None:
            out["full_mask"] = _mixed(take_rows(self.full_mask, self.pcount(count)))
        if self.codes.shape[0]:
            out["codes"] = take_rows(self.codes, self.qcount)
            for name in ("scales", "zeros", "usize"):
                t = getattr(self, name)
                out[name] = None if t is None else take_rows(t, self.ucount)
        return dataclasses.replace(self, **out)


@dataclasses.dataclass(frozen=True)
class Positions:
    """The true positions of a store's entries (segment-major, increasing inside a segment) with ``count [S]``.

    One position per entry, shared by keys and values, in the narrowest signed integer dtype that holds the
    largest one (:func:`narrow_int`: int16 below 32768). The representation depends only on which entries are
    held, never on how they got there, so a store that evicted entries holds exactly the bytes of one written
    with the kept entries only.
    """

    count: torch.Tensor
    pos: torch.Tensor
    top: int = 0
    """The largest position held (0 when empty), kept so an append needs no reduction over every position."""

    @classmethod
    def of(cls, pos: torch.Tensor, count: torch.Tensor) -> Positions:
        """Positions ``pos [N]`` with ``count [S]`` entries per segment."""
        top = int(pos.max()) if pos.numel() else 0
        return cls(count.long(), pos.to(narrow_int(top)), top)

    def flat(self) -> torch.Tensor:
        """int64 ``[N]`` positions."""
        return self.pos.long()

    def last(self) -> torch.Tensor:
        """int64 ``[S]`` last position of every segment (``-1`` when empty)."""
        if self.pos.numel() == 0:
            return torch.full_like(self.count, -1)
        end = (torch.cumsum(self.count, 0) - 1).clamp_min(0)
        return torch.where(self.count > 0, self.pos[end].long(), -1)

    def append(self, new: torch.Tensor) -> Positions:
        """Positions after ``new [S, n]`` (increasing, after every held one) were appended to every segment."""
        n = new.shape[1]
        top = max(int(new.max()) if new.numel() else 0, self.top)
        dtype = narrow_int(top)
        flat = interleave(self.pos.to(dtype), self.count, new.reshape(-1).to(dtype), torch.full_like(self.count, n))
        return Positions(self.count + n, flat, top)

    def keep(self, keep: torch.Tensor) -> Positions:
        S = self.count.numel()
        return Positions.of(self.pos[keep], torch.bincount(segment_ids(self.count)[keep], minlength=S))

    def take(self, take: torch.Tensor) -> Positions:
        idx, _ = segment_take(segment_ids(self.count), take, self.count.numel())
        return Positions.of(self.pos[idx], self.count[take])
