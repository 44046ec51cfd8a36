"""Triton kernels: fused mixed-tier decode attention over a HqeKV cache, and its reduced attention row.

Split-KV layout (FlashDecoding): program ``(s, j)`` owns KV head ``s = b·Hkv + h`` (all ``Hq/Hkv · Q`` query rows of
its GQA group, K/V never repeated) and ``TILES`` tiles of ``BLOCK_T`` entries starting at ``j·TILES·BLOCK_T``; for
every entry it gathers the key from the key's tier and the value from the value's tier (fp16 rows, 4-/2-bit uniform
codes, 1-bit normalized codes; :mod:`kv_hqekv.kernels.triton_tiles`), dequantized in registers, with an online
softmax (Dao et al. 2022, "FlashAttention", §3.1). Each split's normalised output and log-sum-exp are merged in one
launch (:func:`kvcodec.kernels.triton_attention.merge_splits`), so the compiled kernel does not depend on the
context length (no recompilation as decoding grows it, loop bounds are compile-time constants as the interpreter
needs). Products run on the matrix units (``tl.dot``, the
query rows padded to 16): in the cache dtype when the query shares it (float16 or bfloat16; the probabilities split
into parts of that dtype, :mod:`kvcodec.kernels.triton_dot`), else in IEEE float32 (the interpreter's path).
Broadcast-and-sum products compiled to 255 registers and 520 bytes of spills per thread for sm_90 (Triton 3.6) at
32-entry tiles; these compile without spills at the default 16-entry tiles in float16 and bfloat16.

The row kernel recomputes the logits of every held entry and sums ``exp(logit - lse)`` over the group's query
rows: the reduced attention row the importance window of HqeKV (§3.2) collects while decoding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv_hqekv.kernels.blocked import BlockedSide, BlockLayout
from kv_hqekv.kernels.tiered import TieredSide
from kv_hqekv.kernels.triton_tiles import OUT_CODE, _block_maps, _dummies, _entry_maps, _mapped_rows, side_args
from kvcodec.kernels.triton_attention import merge_splits
from kvcodec.kernels.triton_dot import (
    as_dot,
    dot_mode,
    load_query_group,
    online_softmax_step,
    qk_dot,
    softmax_result,
)


@triton.jit(do_not_specialize=["T", "A"])  # the width grows every step: one compiled variant, not two
def _tiered_attention_kernel(
    q_ptr, out_ptr, lse_ptr,
    kt, kr, kg, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1, KC, KPW4, KPW2, KPW1,
    vt, vr, vg, vf, vc4, vs4, vz4, vk4, vc2, vs2, vz2, vk2, vc1, vs1, vz1, vk1, VC, VPW4, VPW2, VPW1,
    nb_ptr, held_ptr, ktail_ptr, vtail_ptr, NB, A,
    sqb, sqh, sqq, sqd, H, T, Q, NSPLIT, scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    TILES: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr,
    KGCOL: tl.constexpr, KHAS4: tl.constexpr, KHAS2: tl.constexpr, KHAS1: tl.constexpr,
    KCB4: tl.constexpr, KCB2: tl.constexpr, KCB1: tl.constexpr,
    VGCOL: tl.constexpr, VHAS4: tl.constexpr, VHAS2: tl.constexpr, VHAS1: tl.constexpr,
    VCB4: tl.constexpr, VCB2: tl.constexpr, VCB1: tl.constexpr, DOT: tl.constexpr,
    BLOCKED: tl.constexpr, G: tl.constexpr, KGROUP_IS_ROW: tl.constexpr, VGROUP_IS_ROW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // H
    h = pid % H
    qv, m, mmask, _hq, _qi, d, dmask = load_query_group(q_ptr, b, h, sqb, sqh, sqq, sqd, Q, GROUP, D, BLOCK_M, BLOCK_D)
    qv = as_dot(qv, DOT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    seg = pid.to(tl.int64)
    if BLOCKED:  # the head's block count, length and tail rows (kv_hqekv.kernels.blocked)
        nb = tl.load(nb_ptr + seg).to(tl.int64)
        hl = tl.load(held_ptr + seg).to(tl.int64)
        ktail = tl.load(ktail_ptr + seg).to(tl.int64)
        vtail = tl.load(vtail_ptr + seg).to(tl.int64)
    for i in range(TILES):
        t = (sp * TILES + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        if BLOCKED:
            kti, kri, kgi = _block_maps(kt, kr, kg, ktail, seg, t, nb, hl, A, NB, G, KGROUP_IS_ROW)
            vti, vri, vgi = _block_maps(vt, vr, vg, vtail, seg, t, nb, hl, A, NB, G, VGROUP_IS_ROW)
        else:
            kti, kri, kgi = _entry_maps(kt, kr, kg, seg * T + t, tmask)
            vti, vri, vgi = _entry_maps(vt, vr, vg, seg * T + t, tmask)
        k = _mapped_rows(
            kti, kri, kgi, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1,
            d, dmask, KC, KPW4, KPW2, KPW1, D, KGCOL, BLOCK_T, BLOCK_D,
            KHAS4, KHAS2, KHAS1, KCB4, KCB2, KCB1, FMAX, OUT,
        )  # fmt: skip
        v = _mapped_rows(
            vti, vri, vgi, vf, vc4, vs4, vz4, vk4, vc2, vs2, vz2, vk2, vc1, vs1, vz1, vk1,
            d, dmask, VC, VPW4, VPW2, VPW1, D, VGCOL, BLOCK_T, BLOCK_D,
            VHAS4, VHAS2, VHAS1, VCB4, VCB2, VCB1, FMAX, OUT,
        )  # fmt: skip
        held = tmask & (kti != 0)
        logits = qk_dot(qv, k, DOT) * scale
        logits = tl.where(held[None, :], logits, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, logits, v, DOT)
    out, lse = softmax_result(m_i, l_i, acc)
    part = (pid.to(tl.int64) * NSPLIT + sp) * (GROUP * Q) + m
    tl.store(out_ptr + part[:, None] * D + d[None, :], out, mask=mmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + part, lse, mask=mmask)


@triton.jit(do_not_specialize=["T"])  # the map width grows every step: one compiled variant, not two
def _tiered_row_kernel(
    q_ptr, lse_ptr, row_ptr,
    kt, kr, kg, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1, KC, KPW4, KPW2, KPW1,
    sqb, sqh, sqq, sqd, H, T, Q, scale,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    TILES: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr,
    KGCOL: tl.constexpr, KHAS4: tl.constexpr, KHAS2: tl.constexpr, KHAS1: tl.constexpr,
    KCB4: tl.constexpr, KCB2: tl.constexpr, KCB1: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // H
    h = pid % H
    qv, _m, mmask, hq, qi, d, dmask = load_query_group(q_ptr, b, h, sqb, sqh, sqq, sqd, Q, GROUP, D, BLOCK_M, BLOCK_D)
    qv = as_dot(qv, DOT)
    lse = tl.load(lse_ptr + (b * (H * GROUP) + hq).to(tl.int64) * Q + qi, mask=mmask, other=float("-inf"))
    seen = lse != float("-inf")
    lse = tl.where(seen, lse, 0.0)
    for i in range(TILES):
        t = (sp * TILES + i) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        base = pid.to(tl.int64) * T + t
        ktier, krow, kgrp = _entry_maps(kt, kr, kg, base, tmask)
        k = _mapped_rows(
            ktier, krow, kgrp, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1,
            d, dmask, KC, KPW4, KPW2, KPW1, D, KGCOL, BLOCK_T, BLOCK_D,
            KHAS4, KHAS2, KHAS1, KCB4, KCB2, KCB1, FMAX, OUT,
        )  # fmt: skip
        held = tmask & (ktier != 0)
        logits = qk_dot(qv, k, DOT) * scale
        p = tl.exp(logits - lse[:, None])
        p = tl.where(seen[:, None] & held[None, :], p, 0.0)
        tl.store(row_ptr + base, tl.sum(p, axis=0), mask=tmask)


def _pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1) - 1).bit_length())


def _common(query: torch.Tensor, keys: TieredSide, block_t: int | None, tiles: int | None, width: int | None = None):
    B, H, T = keys.tier.shape
    T = T if width is None else width
    Hq, Q = query.shape[1], query.shape[2]
    D = keys.head_dim
    group = Hq // H
    bt = max(16, _pow2(block_t if block_t is not None else 16))  # tl.dot needs >= 16; 32 spills in bfloat16
    tl_ = tiles if tiles is not None else 4
    nsplit = max(1, triton.cdiv(T, bt * tl_))
    meta = dict(
        GROUP=group,
        D=D,
        BLOCK_M=max(16, _pow2(group * Q)),
        BLOCK_T=bt,
        BLOCK_D=max(16, _pow2(D)),
        TILES=tl_,
        FMAX=float(torch.finfo(keys.dtype).max),
        OUT=OUT_CODE[keys.dtype],
    )
    return B, H, T, Hq, Q, D, group, nsplit, meta


def _prefixed(meta: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in meta.items()}


def tiered_attention_triton(
    query: torch.Tensor,
    keys: TieredSide,
    values: TieredSide,
    scale: float,
    *,
    block_t: int | None = None,
    tiles: int | None = None,
    num_warps: int = 8,
    tensor_cores: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kv_hqekv.kernels.reference.tiered_attention_ref` (same arguments, same results up to float32
    summation order); ``block_t`` entries per tile (at least 16), ``tiles`` tiles per program; ``tensor_cores``
    as in :func:`kvcodec.kernels.triton_dot.dot_mode`."""
    return _attention(query, None, keys, values, scale, block_t, tiles, num_warps, tensor_cores)


def blocked_attention_triton(
    query: torch.Tensor,
    layout: BlockLayout,
    keys: BlockedSide,
    values: BlockedSide,
    scale: float,
    *,
    block_t: int | None = None,
    tiles: int | None = None,
    num_warps: int = 8,
    tensor_cores: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kv_hqekv.kernels.reference.blocked_attention_ref`: the kernel of
    :func:`tiered_attention_triton` with every entry's tier and rows computed from the block maps
    (:mod:`kv_hqekv.kernels.blocked`) instead of read from per-entry maps; same results up to float32 summation
    order."""
    return _attention(query, layout, keys, values, scale, block_t, tiles, num_warps, tensor_cores)


def _attention(query, layout, keys, values, scale, block_t, tiles, num_warps, tensor_cores):
    width = None if layout is None else layout.width
    B, H, T, Hq, Q, D, group, nsplit, meta = _common(query, keys, block_t, tiles, width)
    meta["DOT"] = dot_mode(query, (keys.dtype, values.dtype), tensor_cores)
    S, M = B * H, group * Q
    if S == 0 or Q == 0 or D == 0 or T == 0:
        out = torch.zeros(B, Hq, Q, D, dtype=torch.float32, device=query.device)
        return out, torch.full((B, Hq, Q), float("-inf"), dtype=torch.float32, device=query.device)
    outp = torch.empty(S, nsplit, M, D, dtype=torch.float32, device=query.device)
    lsep = torch.empty(S, nsplit, M, dtype=torch.float32, device=query.device)
    kargs, kmeta = side_args(keys)
    vargs, vmeta = side_args(values)
    if layout is None:
        dummy = _dummies(query.device)[2]
        blocked = [dummy, dummy, dummy, dummy, 0, 0]
        meta.update(BLOCKED=False, G=1, KGROUP_IS_ROW=False, VGROUP_IS_ROW=False)
    else:
        blocked = [layout.blocks, layout.held, keys.tail, values.tail, keys.tier.shape[-1], layout.appended]
        meta.update(BLOCKED=True, G=layout.block)
    _tiered_attention_kernel[(S, nsplit)](
        query, outp, lsep, *kargs, *vargs, *blocked, *query.stride(), H, T, Q, nsplit, float(scale),
        **meta, **_prefixed(kmeta, "K"), **_prefixed(vmeta, "V"),
        num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    out, lse = merge_splits(outp, lsep, num_warps)  # one launch (kvcodec's log-sum-exp merge of the splits)
    return out.view(B, Hq, Q, D), lse.view(B, Hq, Q)


def tiered_attention_row_triton(
    query: torch.Tensor,
    keys: TieredSide,
    scale: float,
    lse: torch.Tensor,
    *,
    block_t: int | None = None,
    tiles: int | None = None,
    num_warps: int = 8,
    tensor_cores: bool | None = None,
) -> torch.Tensor:
    """Triton :func:`~kv_hqekv.kernels.reference.tiered_attention_row_ref` (same arguments, same results up to
    float32 summation order)."""
    B, H, T, _Hq, Q, D, _group, nsplit, meta = _common(query, keys, block_t, tiles)
    meta["DOT"] = dot_mode(query, (keys.dtype,), tensor_cores)
    row = torch.zeros(B, H, T, dtype=torch.float32, device=query.device)
    if B * H == 0 or Q == 0 or D == 0 or T == 0:
        return row
    kargs, kmeta = side_args(keys)
    _tiered_row_kernel[(B * H, nsplit)](
        query, lse.float().contiguous(), row, *kargs, *query.stride(), H, T, Q, float(scale),
        **meta, **_prefixed(kmeta, "K"),
        num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    return row
