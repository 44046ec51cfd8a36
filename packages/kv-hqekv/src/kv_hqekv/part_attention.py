"""Decode attention over an :class:`~kv_hqekv.HqeKVStore` computed part by part: the store's CPU path.

The fused kernel (:func:`kv_hqekv.kernels.tiered_attention`) reads every entry through per-entry index maps, which
suits a GPU thread per entry; on a CPU, building those maps and gathering every entry's group statistics cost
far more than the attention itself. Here each held part (the fp16 rows and the 4-, 2- and 1-bit code tables of the
keys and of the values) is read once in its own layout, with the group statistics broadcast per unit instead of
gathered per entry:

* **keys**, quantized per channel in units of ``G`` tokens (§3.4): ``k = z_u + y·s_u`` with ``y`` the code (uniform)
  or its codebook value (normalized), so ``q·k = (q ⊙ s_u)·y + q·z_u`` — the scale is folded into the query of
  each unit and the logits come from one batched product over the unpacked codes, with no dequantized key;
* **values**, quantized per token in groups of ``G`` channels, are dequantized per part (statistics broadcast over
  the group, one tier at a time in per-thread scratch) and scattered once into an ``[S, T, D]`` layout for one
  batched product with the probabilities.

Entries are placed in ``[S, ·, T]`` columns (:class:`_Columns`): by true position (position minus the smallest
held one) while the held positions are dense — no sort, the columns of evicted positions stay empty — and by their
slot in ``read()`` (the segment's keys sorted by position) otherwise; a value takes its key's column (a value
evicted under a kept key fills none and contributes ``V = 0``, as in ``read()``). float32 caches fold the scales as
above; half-precision caches dequantize and round every entry to their dtype first, as ``read()`` does. Results
equal ``kvcore.reference_attention(store.read(), query, scale)`` within float tolerance.
"""

from __future__ import annotations

import functools

import torch

from kvcodec.packing import unpack_unchecked
from kvcodec.ragged import QuantUnits, Residual
from kvcodec.scratch import scratch
from kvcodec.segments import offsets_in_segment, rank_in_segment


@functools.cache
def _word_shifts(bits: int, device: torch.device) -> torch.Tensor:
    """int32 ``[1, 1, 32 // bits]``: the bit offset of every code of a little-endian 32-bit word."""
    return (torch.arange(32 // bits, device=device, dtype=torch.int32) * bits).view(1, 1, -1)


def _stats(units: QuantUnits, fold: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, zeros)`` float32 ``[nu, C]`` of a tier. With ``fold`` a 2-entry codebook (the normalized 1-bit tier
    and its uniform ablation: ``codebook[code]·s + z``) is folded into the uniform form ``zero + code·scale`` as
    ``(z + lo·s) + code·((hi - lo)·s)``; without, the codes must be mapped through :func:`_code_values`."""
    s, z = units.scales[: units.nu].flatten(1).float(), units.zeros[: units.nu].flatten(1).float()
    if units.codebook is None or not fold:
        return s, z
    if units.codebook.numel() != 2:
        raise NotImplementedError("part_attention folds the codebook of a 1-bit tier only (HqeKV's normalized tier)")
    lo, hi = units.codebook.float().to(s.device)
    return (hi - lo) * s, z + lo * s


def _codes(units: QuantUnits, D: int, name: str) -> torch.Tensor:
    """float32 ``[nr, D]`` codes of a tier's rows, unpacked into per-thread scratch ``name``.

    Rows whose packed width is a whole number of 32-bit words are unpacked word-wise (one shift broadcast over
    ``32 / bits`` codes per word and one mask, in int32: byte-wise shifts broadcast over 2-8 lanes are several
    times slower on a CPU); other widths go through :func:`kvcodec.packing.unpack_unchecked`."""
    bits = units._meta[0]
    codes = units.codes[: units.nr]
    nr, P = codes.shape
    out = scratch(name, nr * D, torch.float32, codes.device).view(nr, D)
    per = 32 // bits
    if P % 4 or D * bits != P * 8 or codes.storage_offset() % 4 or not codes.is_contiguous():
        return out.copy_(unpack_unchecked(codes, bits, D))
    words = codes.view(torch.int32)  # [nr, P / 4]
    lanes = scratch(name + "_int", nr * D, torch.int32, codes.device).view(nr, P // 4, per)
    torch.bitwise_right_shift(words[:, :, None], _word_shifts(bits, codes.device), out=lanes)
    lanes.bitwise_and_((1 << bits) - 1)
    return out.copy_(lanes.view(nr, D))


def _code_values(units: QuantUnits, D: int, name: str, fold: bool) -> torch.Tensor:
    """:func:`_codes`, mapped through the tier's codebook unless ``fold`` (see :func:`_stats`)."""
    y = _codes(units, D, name)
    if units.codebook is None or fold:
        return y
    return units.codebook.float().to(y.device)[y.long()]


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantized float32 entries as the store's quantizers return them in ``dtype`` (clamped, rounded), as float32."""
    fmax = torch.finfo(dtype).max
    return x.clamp_(-fmax, fmax).to(dtype).float()


def _key_logits(units: QuantUnits, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[nr, gQ]`` logits ``q·k`` of a key tier's rows (unscaled), ``q [S, gQ, D]`` float32.

    float32 caches: the scale is folded into the query of each unit, ``q·(z + c·s) = (q ⊙ s)·c + q·z``, so no key
    is dequantized. Other dtypes: the keys are dequantized and rounded to the dtype first, as ``read()`` does."""
    D = q.shape[-1]
    nu, nr, U = units.nu, units.nr, units.unit
    fold = dtype == torch.float32
    s, z = _stats(units, fold)  # [nu, D]: one group per (unit, channel)
    y = _code_values(units, D, "hqekv_keys", fold)
    qu = q[units.seg]  # [nu, gQ, D]
    if nr != nu * U:  # some unit lost rows (crop, eviction): lay the rows out in their units' cells, zero elsewhere
        cell = units.row_unit() * U + offsets_in_segment(units.rows[:nu])
        y = torch.zeros(nu * U, D, device=y.device).index_copy_(0, cell, y)
    y = y.view(nu, U, D)
    if not fold:
        k = _rounded(y * s[:, None, :] + z[:, None, :], dtype)
        logits = torch.bmm(k, qu.transpose(1, 2)).reshape(nu * U, -1)
        return logits if nr == nu * U else logits[cell]
    logits = torch.bmm(y, (qu * s[:, None, :]).transpose(1, 2))  # [nu, U, gQ]
    logits = (logits + torch.einsum("ujd,ud->uj", qu, z)[:, None, :]).reshape(nu * U, -1)
    return logits if nr == nu * U else logits[cell]


def _value_rows(units: QuantUnits, D: int, G: int, dtype: torch.dtype) -> torch.Tensor:
    """``[nr, D]`` float32 dequantized rows of a value tier (per token, groups of ``G`` channels; ``U = 1``), rounded
    to ``dtype`` as ``read()`` returns them (in per-thread scratch for float32)."""
    nr = units.nr
    fold = dtype == torch.float32
    s, z = _stats(units, fold)  # [nr, C]
    y = _code_values(units, D, "hqekv_values", fold)
    C = s.shape[1]
    if C * G == D:
        y.view(nr, C, G).mul_(s[:, :, None]).add_(z[:, :, None])
    else:
        group = torch.arange(D, device=y.device) // G
        y.mul_(s[:, group]).add_(z[:, group])
    return y if fold else _rounded(y, dtype)


def _queries(store, query: torch.Tensor) -> torch.Tensor:
    """``query [B, Hq, Q, D]`` as float32 ``[S, gQ, D]``: the ``g·Q`` query rows of every (batch row, KV head)."""
    B, H, D = store._shape
    Hq, Q = query.shape[1], query.shape[2]
    return query.float().reshape(B, H, (Hq // H) * Q, D).reshape(B * H, -1, D)


def _key_entries(store, q: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(seg [N], pos [N], logits [N, gQ])`` int64/int64/float32 of every held key, part by part."""
    fp16, *quant = store._parts["k"]
    seg, pos = fp16.positions()
    segs, poss = [seg.long()], [pos.long()]
    logits = [torch.einsum("njd,nd->nj", q[seg.long()], fp16.rows.float())]
    for units in quant:
        if units.empty:
            continue
        seg, pos = units.positions()
        segs.append(seg.long())
        poss.append(pos.long())
        logits.append(_key_logits(units, q, store._dtype))
    return torch.cat(segs), torch.cat(poss), torch.cat(logits).mul_(scale)


class _Columns:
    """Where each entry goes in the ``[S, ·, T]`` layouts: its slot in ``read()`` (the segment's keys sorted by
    position, ``by_position=False``), or, when the held positions are dense enough (an HqeKV cache evicts a
    minority of its blocks), its position minus the smallest held position — no sort and no search, the columns of
    evicted positions simply stay empty."""

    def __init__(self, seg: torch.Tensor, pos: torch.Tensor, S: int, by_position: bool | None = None) -> None:
        lo = int(pos.min()) if pos.numel() else 0
        span = int(pos.max()) - lo + 1 if pos.numel() else 0
        if by_position is None:
            by_position = S * span <= 2 * pos.numel() + 64
        self.by_position, self.lo, self.span = by_position, lo, span
        if by_position:
            self.T, self.keys = span, pos - lo
            return
        code = seg * span + (pos - lo)  # unique per entry
        order = torch.argsort(code)
        self.sorted_code = code[order]
        self.rank, counts = rank_in_segment(seg[order], S)
        self.T = int(counts.max()) if S else 0
        self.keys = torch.empty_like(self.rank)
        self.keys[order] = self.rank

    def of(self, seg: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Columns of entries ``(seg, pos)`` whose keys are held (values: a held value always has its key)."""
        if self.by_position:
            return pos.long() - self.lo
        return self.rank[torch.searchsorted(self.sorted_code, seg.long() * self.span + (pos.long() - self.lo))]


def _logits(store, q: torch.Tensor, scale: float, by_position: bool | None) -> tuple[torch.Tensor, _Columns]:
    """Scaled logits ``[S, gQ, T]`` (``-inf`` where no key is held) and their column layout."""
    seg, pos, logit = _key_entries(store, q, scale)
    S = q.shape[0]
    cols = _Columns(seg, pos, S, by_position)
    dense = torch.full((S, q.shape[1], cols.T), float("-inf"), device=q.device)
    dense[seg, :, cols.keys] = logit
    return dense, cols


def part_attention(
    store, query: torch.Tensor, scale: float, by_position: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out float32 [B, Hq, Q, D], lse float32 [B, Hq, Q])`` of ``query`` (checked, on the store's device) over
    everything ``store`` holds (module doc). ``by_position`` forces a column layout (:class:`_Columns`; default:
    by position when the held positions are dense enough)."""
    B, _, D = store._shape
    Hq, Q = query.shape[1], query.shape[2]
    q = _queries(store, query)
    logits, cols = _logits(store, q, scale, by_position)
    S, _, T = logits.shape
    if T == 0:  # nothing held
        return torch.zeros(B, Hq, Q, D, device=q.device), torch.full((B, Hq, Q), float("-inf"), device=q.device)
    m = logits.amax(-1, keepdim=True)
    e = logits.sub_(torch.where(torch.isfinite(m), m, 0.0)).exp_()  # unnormalised; the output is divided once
    total = e.sum(-1, keepdim=True)
    values = scratch("hqekv_dense_values", S * T * D, torch.float32, q.device).view(S, T, D).zero_()
    for part in store._parts["v"]:
        seg, pos = part.positions()
        if not seg.numel():
            continue
        rows = part.rows if isinstance(part, Residual) else _value_rows(part, D, store.block, store._dtype)
        values[seg.long(), cols.of(seg, pos)] = rows.float()  # each tier's rows placed before the next is unpacked
    out = torch.bmm(e, values).div_(total.clamp_min(torch.finfo(torch.float32).tiny))  # [S, gQ, D]
    lse = total.log_().add_(m)
    return out.view(B, Hq, Q, D), lse.view(B, Hq, Q)


def part_attention_row(store, query: torch.Tensor, scale: float, lse: torch.Tensor | None) -> torch.Tensor:
    """``[B, Hkv, T]`` float32 attention row (:func:`kv_hqekv.attention.attention_row`) under ``lse [B, Hq, Q]``
    (``None``: this store's own), laid out like ``read()``."""
    B, H, _ = store._shape
    logits, _ = _logits(store, _queries(store, query), scale, by_position=False)
    S, gQ, T = logits.shape
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse.float().reshape(S, gQ)
    finite = torch.isfinite(lse)[..., None]
    p = torch.where(finite, torch.exp(logits - torch.where(finite, lse[..., None], 0.0)), 0.0)
    return p.sum(1).view(B, H, T)
