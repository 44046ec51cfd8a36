"""Decode attention v2 over HqeKV's mixed tiers: the *folded* formulation of :mod:`kvcodec.decode_v2` (issue 43),
read from the store's block layout (:mod:`kv_hqekv.kernels.blocked`) in place.

HqeKV's quantized tiers are KIVI's layout per block: keys quantized **per channel over the block's** ``G`` **tokens**
(one parameter row per block), values **per token in groups of** ``G`` **channels**. So each block is one folded
step of whatever tier it holds on each side:

* **keys**, tier ``b`` in 4 / 2 / 1: ``q · k_t = Σ_d (q_d s_d) c_td + q · z`` -- the block's scales folded into the
  query (``q ⊙ s`` as two float16 parts, the matrix-unit operands), its zeros into one bias per query row;
* **values**, tier ``b``: ``Σ_t p_t v_td = Σ_t round16(p_t s_tc) c_td + Σ_t p_t z_tc``;
* the **normalized 1-bit tier** folds the same way: its reconstruction ``mean + codebook[code] · std`` is affine in
  the code bit, ``(mean + cb_0 std) + code · (cb_1 - cb_0) std``, so it is a uniform 1-bit tier with scale
  ``(cb_1 - cb_0) std`` and zero ``mean + cb_0 std`` (computed in float32 from the held statistics, nothing stored);
* fp16 blocks and the fp16 tail (the decode residual) enter as they are; a value tier 0 (a value evicted under its
  kept key) adds nothing to the output and its logit stays in the denominator.

Why not one :func:`kvcodec.decode_v2.kivi_decode_v2` call per tier, merged by log-sum-exp: HqeKV ranks keys and
values separately, so a token's key and value sit in different tiers (a per-tier attention would need up to 16 (key
tier, value tier) pairs), every head holds a different number of blocks per tier (ragged), and the tier tables keep
one code row per token (token-outer ``[N, P]``, the ``kvcore.QuantizedTensor`` layout) where
:class:`~kvcodec.decode_v2.PackedKIVI` has token-inner per-head buffers: viewing a tier as ``PackedKIVI`` would
need a copy (a layout conversion per re-plan of ~1x the code bytes, and padding the ragged heads). Instead one
pass over the blocks computes each block's logits from its key tier and its value step from its value tier, all in
one online softmax: no merge, no conversion, **0 extra bytes** -- the codes are read where the store holds them.

:func:`blocked_decode_v2_ref` is the PyTorch reference (float32, with the kernel's float16 roundings of the matrix
operands); :func:`kv_hqekv.kernels.triton_folded.blocked_decode_v2_triton` the Triton kernel of the same signature;
:func:`blocked_decode_v2` picks one. :func:`contract_errors` measures a result against ``docs/protocols.md``'s
tolerance contract (:data:`kvcodec.decode_v2.OUT_RTOL`, :data:`~kvcodec.decode_v2.LSE_ATOL`) over the entries as
``read()`` gives them.
"""

from __future__ import annotations

import torch

from kv_hqekv.kernels.blocked import BlockedSide, BlockLayout, expand_side
from kv_hqekv.kernels.tiered import FULL_TIER, NO_ENTRY, TieredSide
from kvcodec.decode_v2 import contract_summary
from kvcodec.kernels.dispatch import use_triton
from kvcodec.packing import unpack_unchecked


def affine_params(t, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(scale, zero)`` of parameter rows ``rows`` of a tier (:class:`~kv_hqekv.kernels.TierCodes`) in the
    uniform form ``zero + code · scale``: as held for the uniform tiers; ``((cb_1 - cb_0) std, mean + cb_0 std)`` for
    the normalized 1-bit tier (module doc)."""
    s, z = t.scales[rows].float(), t.zeros[rows].float()
    if t.codebook is None:
        return s, z
    cb = t.codebook.float().to(s.device)
    return s * (cb[1] - cb[0]), z + cb[0] * s


def _split16(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the sum of two float16 parts (hi + lo), as the kernel's two products take it."""
    hi = x.half().float()
    return hi + (x - hi).half().float()


def _segments(query: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, int, int]:
    """``query [B, Hq, Q, D]`` as float32 ``[S, M, D]`` (``S = B·Hkv`` heads, the ``M = (Hq / Hkv)·Q`` query rows of
    each KV head), with ``(S, M)``."""
    B, Hq, Q, D = query.shape
    H = layout.blocks.shape[1]
    M = Hq // H * Q
    return query.float().reshape(B * H, M, D), B * H, M


def _block_rows(side: BlockedSide, sel: torch.Tensor, G: int, shift: torch.Tensor | None) -> torch.Tensor:
    """``[n, G]`` rows of the selected blocks' entries (first row + offset; full rows moved by ``s · appended``)."""
    s_i, j_i = sel
    first = side.row.flatten(0, 1)[s_i, j_i].long()
    if shift is not None:
        first = first + shift[s_i]
    return first[:, None] + torch.arange(G, device=first.device)


def blocked_decode_v2_ref(
    query: torch.Tensor, layout: BlockLayout, keys: BlockedSide, values: BlockedSide, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of ``query [B, Hq, Q, D]`` over a cache addressed by blocks, in the folded formulation (module
    doc), in PyTorch (any device): ``(out float32 [B, Hq, Q, D], lse float32 [B, Hq, Q])``, the reference of
    :func:`~kv_hqekv.kernels.triton_folded.blocked_decode_v2_triton`. Within the tolerance contract of attention over
    the dequantized entries (:func:`contract_errors`), not bit for bit."""
    B, Hq, Q, D = query.shape
    qs, S, M = _segments(query, layout)
    qs = qs * scale
    G, T, a = layout.block, layout.width, layout.appended
    device = qs.device
    nb = layout.blocks.flatten().long().to(device)
    NB = keys.tier.shape[-1]
    nbt = max(-(-T // G), NB)
    logits = torch.full((S, M, nbt * G), float("-inf"), device=device)
    blk = logits.view(S, M, nbt, G)
    shift = torch.arange(S, device=device) * a
    in_block = (torch.arange(NB, device=device) < nb[:, None]) if NB else torch.zeros(S, 0, dtype=torch.bool)
    ktier = keys.tier.flatten(0, 1).to(device)
    for b, t in keys.tiers.items():
        sel = ((ktier == b) & in_block).nonzero(as_tuple=True)
        if not sel[0].numel():
            continue
        rows = _block_rows(keys, sel, G, None)
        c = unpack_unchecked(t.codes[rows.flatten()], b, D).float().view(-1, G, D)
        s, z = affine_params(t, keys.group.flatten(0, 1)[sel].long())  # [n, D]: one parameter row per block
        q = qs[sel[0]]  # [n, M, D]
        qf = _split16(q * s[:, None, :])
        blk[sel[0], :, sel[1]] = torch.einsum("nmd,ngd->nmg", qf, c) + (q @ z[:, :, None])
    sel = ((ktier == FULL_TIER) & in_block).nonzero(as_tuple=True)
    if sel[0].numel():
        k = keys.full[_block_rows(keys, sel, G, shift)].float()  # [n, G, D]
        blk[sel[0], :, sel[1]] = qs[sel[0]] @ k.transpose(1, 2)
    tt = torch.arange(nbt * G, device=device)
    tail = (tt >= nb[:, None] * G) & (tt < layout.held.flatten().long().to(device)[:, None] + a)  # [S, T']
    ts, tt_i = tail.nonzero(as_tuple=True)
    if ts.numel():
        rows = keys.tail.flatten().long().to(device)[ts] + shift[ts] + tt_i - nb[ts] * G
        k = keys.full[rows].float()
        logits[ts, :, tt_i] = (qs[ts] * k[:, None, :]).sum(-1)
    mx = logits.amax(-1, keepdim=True)
    e = torch.exp(logits - torch.where(torch.isfinite(mx), mx, 0.0))
    total = e.sum(-1, keepdim=True)
    eb = e.view(S, M, nbt, G)
    out = torch.zeros(S, M, D, device=device)
    vtier = values.tier.flatten(0, 1).to(device)
    GV = values.group_size
    C = D // GV
    for b, t in values.tiers.items():
        sel = ((vtier == b) & in_block).nonzero(as_tuple=True)
        if not sel[0].numel():
            continue
        rows = _block_rows(values, sel, G, None).flatten()  # a value's parameter row is its code row
        c = unpack_unchecked(t.codes[rows], b, D).float().view(-1, G, C, GV)
        s, z = (x.view(-1, G, C) for x in affine_params(t, rows))
        p = eb[sel[0], :, sel[1]]  # [n, M, G]
        ph = (p[:, None] * s.transpose(1, 2)[:, :, None]).half().float()  # [n, C, M, G]
        o = torch.einsum("ncmg,ngcx->nmcx", ph, c) + torch.einsum("nmg,ngc->nmc", p, z)[..., None]
        out.index_add_(0, sel[0], o.reshape(-1, M, D))
    sel = ((vtier == FULL_TIER) & in_block).nonzero(as_tuple=True)
    if sel[0].numel():
        v = values.full[_block_rows(values, sel, G, shift)].float()
        out.index_add_(0, sel[0], eb[sel[0], :, sel[1]] @ v)
    if ts.numel():
        rows = values.tail.flatten().long().to(device)[ts] + shift[ts] + tt_i - nb[ts] * G
        out.index_add_(0, ts, e[ts, :, tt_i][:, :, None] * values.full[rows].float()[:, None, :])
    safe = torch.where(total > 0, total, 1.0)
    lse = torch.where(total > 0, torch.log(safe) + mx, float("-inf"))
    H = S // B
    return (out / safe).view(B, H, Hq // H, Q, D).reshape(B, Hq, Q, D), lse.view(B, Hq, Q)


def blocked_decode_v2(
    query: torch.Tensor, layout: BlockLayout, keys: BlockedSide, values: BlockedSide, scale: float, **kernel_options
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (:func:`kv_hqekv.kernels.triton_folded.blocked_decode_v2_triton`) on CUDA for the caches it
    takes (:func:`~kv_hqekv.kernels.triton_folded.supported`), else :func:`blocked_decode_v2_ref`."""
    if use_triton(query):
        from kv_hqekv.kernels import triton_folded as kernel

        if kernel.supported(query, layout, keys, values):
            return kernel.blocked_decode_v2_triton(query, layout, keys, values, scale, **kernel_options)
    return blocked_decode_v2_ref(query, layout, keys, values, scale)


# ------------------------------------------------------------------------------------------------------------------
# The tolerance contract (docs/protocols.md, "Fast decode paths: the tolerance contract")
# ------------------------------------------------------------------------------------------------------------------


def dequantized_side(side: TieredSide, rounded: bool = True) -> torch.Tensor:
    """float32 ``[*side.tier.shape, D]``: the entries as ``read()`` gives them (the quantizers' formulas in float32,
    rounded to the cache dtype) or, where not ``rounded``, left in float32; 0 where ``tier == 0``."""
    from kv_hqekv.kernels.reference import dequantize_side_ref

    if rounded or side.dtype == torch.float32:
        return dequantize_side_ref(side).float()
    wide = TieredSide(
        side.full.float(), side.tiers, side.tier, side.row, side.group, side.axis, side.group_size
    )  # the same formulas, float32 output
    return dequantize_side_ref(wide)


def attention_over_dequantized(
    query: torch.Tensor, layout: BlockLayout, keys: BlockedSide, values: BlockedSide, scale: float, rounded=True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [S, M, D], lse [S, M, 1])`` float32: plain attention over the dequantized entries
    (:func:`dequantized_side`), per KV head ``s`` and its query rows."""
    ek, ev = expand_side(layout, keys), expand_side(layout, values)
    qs, _, _ = _segments(query, layout)
    k = dequantized_side(ek, rounded).flatten(0, 1)
    v = dequantized_side(ev, rounded).flatten(0, 1)
    logits = (qs * scale) @ k.transpose(1, 2)
    logits = logits.masked_fill((ek.tier == NO_ENTRY).flatten(0, 1)[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, -1, keepdim=True)
    return torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0.0)) @ v, lse


def contract_errors(
    out: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    layout: BlockLayout,
    keys: BlockedSide,
    values: BlockedSide,
    scale: float,
) -> dict[str, float]:
    """:func:`kvcodec.decode_v2.contract_errors` for ``(out [B, Hq, Q, D], lse [B, Hq, Q])`` over a blocked HqeKV
    cache: the worst ratio over query rows of the error against attention over ``read()``'s entries to the
    allowance ``OUT_RTOL + 2 e_out`` / ``LSE_ATOL + 2 e_lse`` (``e`` the row's own error of ``read()``'s rounding),
    ``<= 1`` meets it; and the worst errors against ``read()`` (``out``, ``lse``) and against the float32
    dequantization (``out_f32``, ``lse_f32``, to be within ``OUT_RTOL`` / ``LSE_ATOL``)."""
    _, S, M = _segments(query, layout)
    D = query.shape[-1]
    out, lse = out.float().reshape(S, M, D), lse.float().reshape(S, M, 1)
    ref = attention_over_dequantized(query, layout, keys, values, scale)
    exact = attention_over_dequantized(query, layout, keys, values, scale, rounded=False)
    return contract_summary(out, lse, ref, exact, empty_rows=True)
