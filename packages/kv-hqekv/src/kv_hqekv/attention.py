"""Decode attention over the mixed tiers of an :class:`~kv_hqekv.HqeKVStore`, read from the packed codes.

:func:`mixed_tier_attention` is the store's fused ``attend``: one pass over the held entries in the order of
``read()``, each entry's key gathered from its key tier and its value from its value tier (fp16 rows, 4-/2-bit
uniform codes, 1-bit normalized codes with the Gaussian-quantile codebook), dequantized in registers, with an
online softmax and GQA (:func:`kv_hqekv.kernels.tiered_attention`, a Triton kernel, on CUDA). Between re-plans the
kernel reads the store's block layout (:meth:`~kv_hqekv.HqeKVStore.decode_layout`: one map entry per block of ``G``
tokens, taken once after a re-plan and advanced by appends, :func:`kv_hqekv.kernels.blocked_attention`) instead of
per-entry maps rebuilt at every step; the per-entry maps remain for caches that are not in whole blocks. On CPU the same
attention is computed part by part (:func:`kv_hqekv.part_attention.part_attention`: key scales folded into the
queries, value tiers dequantized one at a time into per-thread scratch), which is several times faster there than
the per-entry maps the kernel and its PyTorch reference read.

:func:`attention_row` gives the attention of every held entry summed over the query heads of its KV head, the row
the importance window (§3.2) accumulates while decoding.

:func:`tier_pair_attention` is the earlier path, kept as an independent cross-check and for the benchmark: one
:func:`kvcodec.quantized_attention` call per (key tier, value tier) pair present (up to 9), merged by log-sum-exp.
"""

from __future__ import annotations

import torch

from kv_hqekv.kernels import TierCodes, TieredSide, blocked_attention, tiered_attention, tiered_attention_row
from kv_hqekv.part_attention import part_attention, part_attention_row
from kvcodec import CodeRows, QuantizedSegment, normal_codebook, quantized_attention
from kvcodec.kernels.dispatch import use_triton
from kvcodec.segments import exclusive_cumsum
from kvcore import FULL, merge_attention
from kvcore.attention import check_query, check_scale

QUANT = (4, 2, 1)

FOLDED_DECODE = False
"""Default of :func:`mixed_tier_attention`'s ``folded``: on CUDA, a decode step over the block layout through decode
attention v2 (:func:`kv_hqekv.kernels.folded.blocked_decode_v2`, the folded formulation: within
``docs/protocols.md``'s tolerance of attention over ``read()``, not bit-exact). Off until a GPU run has checked the
compiled kernel (as kv-baselines' ``FOLDED_DECODE`` for KIVI); the CPU path never changes."""


def _uniform_params(units, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scales, zeros)`` float32 ``[nu, C]`` of a tier's units in the uniform ``zero + code·scale`` form."""
    s, z = units.scales[: units.nu].flatten(1).float(), units.zeros[: units.nu].flatten(1).float()
    if bits == 1:  # normalized: mean ± c·std  ->  (mean - c·std) + code·(2c·std)
        c = float(normal_codebook(1)[1])
        return 2 * c * s, z - c * s
    return s, z


def tier_pair_attention(store, query: torch.Tensor, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The earlier path (module doc). Attention of ``query [B, Hq, Q, D]`` over everything ``store`` holds;
    ``(out fp32 [B, Hq, Q, D], lse fp32 [B, Hq, Q])``, equal to ``kvcore.reference_attention(store.read(), query,
    scale)`` within float tolerance (a value evicted while its key is kept contributes ``V = 0``)."""
    B, H, D = store._shape
    q = check_query(query, H, D, B)
    scale = check_scale(scale, D)
    S = B * H
    T = store.held_max_length()
    device = store._parts["k"][0].length.device
    dtype = store._dtype
    q = q.to(device)
    nothing = (
        torch.zeros(q.shape, dtype=torch.float32, device=device),
        torch.full(q.shape[:-1], float("-inf"), device=device),
    )
    if T == 0:
        return nothing
    sides = {}
    held = store._all_slots()  # one sort of the held entries for both sides
    for kind in ("k", "v"):
        fp16, *quant = store._parts[kind]
        slots = [(seg, slot) for seg, slot, _ in held[kind].parts()]
        n_full = fp16.rows.shape[0]
        full = torch.cat([fp16.rows, torch.zeros(1, D, dtype=dtype, device=device)])  # + a zero row
        tier = torch.zeros(S, T, dtype=torch.uint8, device=device)  # 0: no entry (value evicted)
        row = torch.full((S, T), -1 - n_full, dtype=torch.long, device=device)  # default: the zero row
        group = torch.zeros(S, T, dtype=torch.long, device=device)
        seg, slot = slots[0]
        tier[seg, slot] = FULL
        row[seg, slot] = -1 - torch.arange(seg.numel(), device=device)
        rows = {}
        for b, units, (seg, slot) in zip(QUANT, quant, slots[1:]):
            if units.empty:
                continue
            tier[seg, slot] = b
            row[seg, slot] = torch.arange(units.nr, device=device)
            group[seg, slot] = units.row_unit()
            scales, zeros = _uniform_params(units, b)
            rows[b] = CodeRows(units.codes, scales, zeros, b, units.quantizer.axis, store.block, full)
        sides[kind] = (tier, row, group, rows, full)
    valid = sides["k"][0] != 0
    parts = []
    for kb in QUANT:
        for vb in QUANT:
            ktier, vtier = sides["k"][0], sides["v"][0]
            kin = (ktier == kb) | ((ktier == FULL) & (kb == 4))
            vin = (vtier == vb) | ((vtier != 1) & (vtier != 2) & (vtier != 4) & (vb == 4))
            mask = valid & kin & vin
            if not bool(mask.any()):
                continue
            cr = []
            for kind, b in (("k", kb), ("v", vb)):
                tier, row, group, rows, full = sides[kind]
                code_rows = rows.get(b)
                if code_rows is None:  # no entry of this side holds the tier: an empty code table
                    pw = (D * b + 7) // 8
                    C = D if kind == "k" else -(-D // store.block)
                    empty = torch.zeros(0, C, device=device)
                    axis = "channel" if kind == "k" else "token"
                    code_rows = CodeRows(
                        torch.zeros(0, pw, dtype=torch.uint8, device=device), empty, empty, b, axis, store.block, full
                    )
                r = torch.where(mask & (tier == b), row, torch.where(tier == FULL, row, -1 - (full.shape[0] - 1)))
                g = torch.where(mask & (tier == b), group, 0)
                cr.append((code_rows, r.view(B, H, T), g.view(B, H, T)))
            bias = torch.where(mask, 0.0, float("-inf")).view(B, H, T)
            (ks, kr, kg), (vs, vr, vg) = cr
            parts.append(quantized_attention(q, QuantizedSegment(ks, vs, kr, kg, vr, vg, bias), scale))
    return merge_attention(parts) if parts else nothing


def _side_entries(store, kind: str) -> tuple:
    """Every held entry of side ``kind``, part by part, concatenated: ``(seg int64, pos int64, tier uint8, row int32,
    group int32)`` (row and group inside the entry's part) and the code tables ``{bits: TierCodes}``. Each part's
    positions and row units are decoded once."""
    fp16, *quant = store._parts[kind]
    device = fp16.length.device
    fseg, fpos = fp16.positions()
    n = fseg.numel()
    segs, poss = [fseg], [fpos]
    tiers = [torch.full((n,), FULL, dtype=torch.uint8, device=device)]
    rows = [torch.arange(n, dtype=torch.int32, device=device)]
    groups = [torch.zeros(n, dtype=torch.int32, device=device)]
    tables = {}
    for b, units in zip(QUANT, quant):
        if units.empty:
            continue
        unit = units.row_unit()
        segs.append(units.seg[unit])
        poss.append(units.pos)
        tiers.append(torch.full((units.nr,), b, dtype=torch.uint8, device=device))
        rows.append(torch.arange(units.nr, dtype=torch.int32, device=device))
        groups.append(unit.int())
        tables[b] = TierCodes.of(units, b)
    cat = (lambda xs: torch.cat(xs)) if len(segs) > 1 else (lambda xs: xs[0])
    return cat([x.long() for x in segs]), cat([x.long() for x in poss]), cat(tiers), cat(rows), cat(groups), tables


def tiered_sides(store) -> tuple[TieredSide, TieredSide]:
    """The keys and values ``store`` holds as :class:`~kv_hqekv.kernels.TieredSide` s whose maps ``[B, Hkv, T]``
    are laid out like ``store.read()`` (the codes are viewed, not copied).

    One sort of the key entries by (segment, position) lays the key maps out; the value entries find their slots
    with one search in it (every held value has its key held). Where every head holds the same number of entries
    the sorted key payload is the map itself."""
    B, H, _ = store._shape
    S = B * H
    kseg, kpos, ktier, krow, kgroup, ktables = _side_entries(store, "k")
    device = kseg.device
    N = kseg.numel()
    counts = torch.bincount(kseg, minlength=S)
    T = store.held_max_length()
    key = (kseg << 32) | kpos
    order = torch.argsort(key)
    sorted_key = key[order]
    start = exclusive_cumsum(counts)

    def scatter(flat, payload, dtype):
        out = torch.zeros(S * T, dtype=dtype, device=device)
        out[flat] = payload
        return out.view(B, H, T)

    if N == S * T:  # equal heads: the sorted payload is the map
        kmaps = tuple(x[order].view(B, H, T) for x in (ktier, krow, kgroup))
    else:
        sseg = kseg[order]
        flat = sseg * T + (torch.arange(N, device=device) - start[sseg])
        kmaps = tuple(scatter(flat, x[order], x.dtype) for x in (ktier, krow, kgroup))
    vseg, vpos, vtier, vrow, vgroup, vtables = _side_entries(store, "v")
    idx = torch.searchsorted(sorted_key, (vseg << 32) | vpos)
    vflat = vseg * T + (idx - start[vseg])
    vmaps = tuple(scatter(vflat, x, x.dtype) for x in (vtier, vrow, vgroup))
    sides = []
    for kind, maps, tables in (("k", kmaps, ktables), ("v", vmaps, vtables)):
        axis = "channel" if kind == "k" else "token"
        sides.append(TieredSide(store._full_rows(kind), tables, *maps, axis, store.block))
    return sides[0], sides[1]


def mixed_tier_attention(
    store, query: torch.Tensor, scale: float | None = None, *, return_row: bool = False, folded: bool | None = None
) -> tuple[torch.Tensor, ...]:
    """Attention of ``query [B, Hq, Q, D]`` over everything ``store`` holds, in one fused pass (module doc).

    Returns ``(out float32 [B, Hq, Q, D], lse float32 [B, Hq, Q])``, equal to
    ``kvcore.reference_attention(store.read(), query, scale)`` within float tolerance (a value evicted while its key
    is kept contributes ``V = 0``); with ``return_row=True`` also :func:`attention_row` under this ``lse``.
    ``folded`` (default :data:`FOLDED_DECODE`): on CUDA, over the block layout, for the caches it takes, the folded
    decode attention v2 (:func:`kv_hqekv.kernels.triton_folded.blocked_decode_v2_triton`) instead: within the
    tolerance contract of ``docs/protocols.md``, not within float tolerance. No effect on CPU.
    """
    if not isinstance(return_row, bool):
        raise TypeError(f"return_row must be a bool, got {type(return_row).__name__}")
    B, H, D = store._shape
    q = check_query(query, H, D, B)
    scale = check_scale(scale, D)
    q = q.to(store._parts["k"][0].rows.device)
    if not use_triton(q):  # CPU: part by part, statistics broadcast per unit (kv_hqekv.part_attention)
        out, lse = part_attention(store, q, scale)
        return (out, lse, part_attention_row(store, q, scale, lse)) if return_row else (out, lse)
    if not return_row:
        blocked = store.decode_layout()  # between re-plans: the block maps, advanced by appends
        if blocked is not None:
            if FOLDED_DECODE if folded is None else folded:
                from kv_hqekv.kernels import triton_folded

                if triton_folded.supported(q, *blocked):
                    return triton_folded.blocked_decode_v2_triton(q, *blocked, scale)
            return blocked_attention(q, *blocked, scale)
    keys, values = tiered_sides(store)
    out, lse = tiered_attention(q, keys, values, scale)
    if not return_row:
        return out, lse
    return out, lse, tiered_attention_row(q, keys, scale, lse)


def attention_row(
    store, query: torch.Tensor, lse: torch.Tensor | None = None, scale: float | None = None
) -> torch.Tensor:
    """``[B, Hkv, T]`` float32, laid out like ``store.read()``: ``Σ_{h ∈ group} Σ_q exp(q·k_t·scale - lse)``, the
    attention probability of every held entry summed over the query heads of its KV head (and the query rows).

    ``lse [B, Hq, Q]`` is the log-sum-exp to normalize by: the store's own (default) or that of an attention merged
    with the step's new tokens (:func:`kvcore.merge_attention`), so the row is the model's true attention row. This
    is the per-step contribution to HqeKV's window importance (§3.2, summed over the last ``m`` queries).
    """
    B, H, D = store._shape
    q = check_query(query, H, D, B)
    scale = check_scale(scale, D)
    if lse is None:
        return mixed_tier_attention(store, q, scale, return_row=True)[2]
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"lse must be a tensor of shape {tuple(q.shape[:3])} (the query's [B, Hq, Q])")
    if not use_triton(q):
        return part_attention_row(store, q.to(store._parts["k"][0].rows.device), scale, lse)
    keys, _ = tiered_sides(store)
    return tiered_attention_row(q.to(keys.tier.device), keys, scale, lse.to(keys.tier.device))
