"""Triton kernel: decode attention v2 (folded) over HqeKV's mixed tiers, read through the block layout in place.

Same contract as :func:`kv_hqekv.kernels.folded.blocked_decode_v2_ref` (its PyTorch reference, same signature):
agreement with attention over the dequantized entries within ``docs/protocols.md``'s tolerance. A tile is one block
of ``G`` entries (``BLOCK_T = G``), so a tile holds one tier per side: its key tier picks the logits' path and its
value tier the value step, branching on the two tier bytes the block layout keeps per block (a tier the side does
not hold is not compiled: ``K4 .. V1``):

* quantized keys (4 / 2 / 1 bit): the block's parameter row folded into the query, ``q ⊙ s`` as two float16 parts,
  times the raw codes on the matrix units, plus the bias ``q · z`` (kvcodec's folded key step;
  :mod:`kvcodec.kernels.triton_decode_v2`);
* quantized values: ``round16(p ⊙ s_c) · code`` with the ``M`` query rows replicated once per channel group (row
  ``c · MB + m``), plus ``Σ p z_c`` per row;
* the normalized 1-bit tier as a uniform one with scale ``(cb_1 - cb_0) std`` and zero ``mean + cb_0 std``
  (:mod:`kv_hqekv.kernels.folded`);
* full-precision blocks and the tail (rows ``r + s · appended``) as they are; a value tier 0 adds nothing.

Codes are turned into float16 operands by their bits as kvcodec's v2 kernel does (:func:`code_halves`: in-place
masks OR-ed into 1024.0's mantissa, one multiply-add), but the lanes are joined in **natural channel order**
(:func:`natural_rows`: the joins' axes permuted in reverse), so every tier's operand, the query and the one
accumulator share channel order: no per-tier query copy or accumulator. The code rows are HqeKV's token-outer
``[N, P]`` rows, loaded as ``[P, G]`` tiles (``G`` consecutive rows of one block). Entries are split over programs
(Flash-Decoding, ``TILES`` compile-time tiles per program) and merged by log-sum-exp
(:func:`kvcodec.kernels.triton_attention.merge_splits`). This module needs ``triton``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv_hqekv.kernels.blocked import BlockedSide, BlockLayout
from kvcodec.kernels.triton_attention import merge_splits, split_plan
from kvcodec.kernels.triton_decode_v2 import (
    _full_key_logits,
    _full_value_step,
    _hdot,
    _load_query,
    _rows,
    _store_split,
    code_halves,
)
from kvcodec.kernels.triton_dot import _weights, dot_mode

QUANT = (4, 2, 1)


@triton.jit
def natural_rows(byte, BITS: tl.constexpr, ASM: tl.constexpr):
    """float16 ``[P * L, N]`` codes of token-inner bytes ``uint8 [P, N]`` (``L = 8 // BITS`` lanes), row ``p * L + j``
    holding lane ``j`` of byte ``p``: channel ``p * L + j``, the natural order (the joins' axes permuted in reverse,
    where :func:`kvcodec.kernels.triton_decode_v2.code_rows` leaves them bit-reversed within a byte)."""
    h = code_halves(byte, BITS, ASM)
    P: tl.constexpr = byte.shape[0]
    N: tl.constexpr = byte.shape[1]
    if BITS == 8:
        return h[0]
    elif BITS == 4:
        return tl.reshape(tl.permute(tl.join(h[0], h[1]), (0, 2, 1)), (P * 2, N))
    elif BITS == 2:
        x = tl.join(tl.join(h[0], h[1]), tl.join(h[2], h[3]))
        return tl.reshape(tl.permute(x, (0, 3, 2, 1)), (P * 4, N))
    else:
        x = tl.join(
            tl.join(tl.join(h[0], h[1]), tl.join(h[2], h[3])), tl.join(tl.join(h[4], h[5]), tl.join(h[6], h[7]))
        )
        return tl.reshape(tl.permute(x, (0, 4, 3, 2, 1)), (P * 8, N))


@triton.jit
def _affine(s, z, cb_ptr, ONE: tl.constexpr):
    """Parameters in the uniform form ``zero + code · scale``: as held, or the normalized 1-bit tier's
    ``((cb_1 - cb_0) std, mean + cb_0 std)`` (``s`` the std, ``z`` the mean)."""
    if ONE:
        cb0 = tl.load(cb_ptr)
        cb1 = tl.load(cb_ptr + 1)
        return s * (cb1 - cb0), z + s * cb0
    else:
        return s, z


@triton.jit
def _code_tile(c_ptr, rows, BITS: tl.constexpr, D: tl.constexpr, ASM: tl.constexpr):
    """float16 ``[D, G]`` codes of token-outer code rows ``rows [G]`` (``D · BITS / 8`` bytes each), natural order."""
    P: tl.constexpr = D * BITS // 8
    pp = tl.arange(0, P)
    byte = tl.load(c_ptr + rows[None, :].to(tl.int64) * P + pp[:, None])
    return natural_rows(byte, BITS, ASM)


@triton.jit
def _fold_keys(
    qk, c_ptr, s_ptr, z_ptr, cb_ptr, rows, grp, scale,
    D: tl.constexpr, CR: tl.constexpr, BITS: tl.constexpr, ONE: tl.constexpr, HALF: tl.constexpr,
    ASM: tl.constexpr, KSPLIT: tl.constexpr,
):  # fmt: skip
    """float32 ``[CR * MB, G]`` scaled logits of one key block (code rows ``rows``, parameter row ``grp``) from its raw
    codes: ``round16(q ⊙ s · scale) · code`` (two float16 parts where ``KSPLIT``) plus ``q · z · scale``."""
    kh = _code_tile(c_ptr, rows, BITS, D, ASM)
    dd = tl.arange(0, D)
    par = grp.to(tl.int64) * D + dd
    sc, zr = _affine(tl.load(s_ptr + par).to(tl.float32), tl.load(z_ptr + par).to(tl.float32), cb_ptr, ONE)
    sc = sc * scale
    zr = zr * scale
    qf = qk * sc[None, :]
    qh = qf.to(tl.float16)
    logits = _hdot(_rows(qh, CR), kh, HALF)
    if KSPLIT:
        logits += _hdot(_rows((qf - qh.to(tl.float32)).to(tl.float16), CR), kh, HALF)
    return logits + _rows(tl.sum(qk * zr[None, :], 1), CR)[:, None]


@triton.jit
def _fold_values(
    acc, zs, p, c_ptr, s_ptr, z_ptr, cb_ptr, rows,
    D: tl.constexpr, C: tl.constexpr, CR: tl.constexpr, MB: tl.constexpr, BITS: tl.constexpr, ONE: tl.constexpr,
    HALF: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """``acc [ROWS, D]`` and ``zs [ROWS]`` advanced by one quantized value block (code and parameter rows ``rows``)
    under ``p [ROWS, G]``: row ``(c, m)`` adds ``round16(p ⊙ s_c) · code`` (every channel; the epilogue keeps group
    ``c``'s) and ``p · z_c``."""
    cg = tl.arange(0, CR)
    ok = (cg < C)[:, None] & (rows >= 0)[None, :]
    par = rows[None, :].to(tl.int64) * C + cg[:, None]
    vs = tl.load(s_ptr + par, mask=ok, other=0.0).to(tl.float32)  # [CR, G]
    vz = tl.load(z_ptr + par, mask=ok, other=0.0).to(tl.float32)
    vs, vz = _affine(vs, vz, cb_ptr, ONE)
    G: tl.constexpr = vs.shape[1]
    vs = tl.reshape(tl.broadcast_to(vs[:, None, :], (CR, MB, G)), (CR * MB, G))
    vz = tl.reshape(tl.broadcast_to(vz[:, None, :], (CR, MB, G)), (CR * MB, G))
    ph = (p * vs).to(tl.float16)
    zs = zs + tl.sum(p * vz, 1)
    return acc + _hdot(ph, tl.trans(_code_tile(c_ptr, rows, BITS, D, ASM)), HALF), zs


_RUNTIME = ["NB", "appended"]


@triton.jit(do_not_specialize=_RUNTIME)
def _blocked_v2_kernel(
    q_ptr, outp_ptr, lsep_ptr, kfull_ptr, vfull_ptr,
    k4c, k4s, k4z, k2c, k2s, k2z, k1c, k1s, k1z, kcb,
    v4c, v4s, v4z, v2c, v2s, v2z, v1c, v1s, v1z, vcb,
    ktier_ptr, krow_ptr, kgrp_ptr, vtier_ptr, vrow_ptr, ktail_ptr, vtail_ptr, nblk_ptr, held_ptr,
    NB, appended, M, scale,
    D: tl.constexpr, G: tl.constexpr, GV: tl.constexpr, MB: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
    DOT: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr, KSPLIT: tl.constexpr,
    K4: tl.constexpr, K2: tl.constexpr, K1: tl.constexpr, V4: tl.constexpr, V2: tl.constexpr, V1: tl.constexpr,
    FULL: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0)
    sp = tl.program_id(1)
    s64 = s.to(tl.int64)
    C: tl.constexpr = D // GV
    CR: tl.constexpr = ROWS // MB
    r = tl.arange(0, ROWS)
    mrow = r % MB
    crow = r // MB
    qok = mrow < M
    dd = tl.arange(0, D)
    tt = tl.arange(0, G)
    qk = _load_query(q_ptr, s64 * M, M, dd, D, MB)
    acc = tl.zeros([ROWS, D], tl.float32)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    zs = tl.zeros([ROWS], tl.float32)
    nb = tl.load(nblk_ptr + s)
    end = tl.load(held_ptr + s) + appended  # entries of this head
    shift = s * appended  # full rows of head s moved by the appends since the layout was taken
    ktail = tl.load(ktail_ptr + s) + shift
    vtail = tl.load(vtail_ptr + s) + shift
    for i in range(TILES):
        j = sp * TILES + i  # the tile's block
        t = j * G + tt
        at = s64 * NB + j
        blk = j < nb
        kt = tl.where(blk, tl.load(ktier_ptr + at, mask=blk, other=0).to(tl.int32), 16)
        vt = tl.where(blk, tl.load(vtier_ptr + at, mask=blk, other=0).to(tl.int32), 16)
        krow0 = tl.load(krow_ptr + at, mask=blk, other=0)
        vrow0 = tl.load(vrow_ptr + at, mask=blk, other=0)
        logits = tl.full([ROWS, G], float("-inf"), tl.float32)  # one branch below runs
        if K4:  # noqa: SIM102 (absent: pruned at compile time; exactly one runs)
            if kt == 4:
                logits = _fold_keys(qk, k4c, k4s, k4z, kcb, krow0 + tt, tl.load(kgrp_ptr + at), scale, D, CR, 4,
                                    False, HALF, ASM, KSPLIT)  # fmt: skip
        if K2:  # noqa: SIM102 (compile-time pruning)
            if kt == 2:
                logits = _fold_keys(qk, k2c, k2s, k2z, kcb, krow0 + tt, tl.load(kgrp_ptr + at), scale, D, CR, 2,
                                    False, HALF, ASM, KSPLIT)  # fmt: skip
        if K1:  # noqa: SIM102 (compile-time pruning)
            if kt == 1:
                logits = _fold_keys(qk, k1c, k1s, k1z, kcb, krow0 + tt, tl.load(kgrp_ptr + at), scale, D, CR, 1,
                                    True, HALF, ASM, KSPLIT)  # fmt: skip
        if FULL:  # noqa: SIM102 (compile-time pruning: a measurement option)
            if kt == 16:  # a full-precision block or the tail
                live = t < end  # every block entry is (blocks come first)
                rows = tl.where(blk, krow0 + shift + tt, ktail + t - nb * G)
                lf = _full_key_logits(qk, kfull_ptr, 0, tl.where(live, rows, 0), live, dd, scale, D, CR, DOT)
                logits = tl.where(live[None, :], lf, float("-inf"))
        m_new, l_i, alpha, p = _weights(m_i, l_i, logits)
        acc = acc * alpha[:, None]
        zs = zs * alpha
        if V4:  # noqa: SIM102 (compile-time pruning)
            if vt == 4:
                acc, zs = _fold_values(acc, zs, p, v4c, v4s, v4z, vcb, vrow0 + tt, D, C, CR, MB, 4, False, HALF, ASM)
        if V2:  # noqa: SIM102 (compile-time pruning)
            if vt == 2:
                acc, zs = _fold_values(acc, zs, p, v2c, v2s, v2z, vcb, vrow0 + tt, D, C, CR, MB, 2, False, HALF, ASM)
        if V1:  # noqa: SIM102 (compile-time pruning)
            if vt == 1:
                acc, zs = _fold_values(acc, zs, p, v1c, v1s, v1z, vcb, vrow0 + tt, D, C, CR, MB, 1, True, HALF, ASM)
        if FULL:  # noqa: SIM102 (compile-time pruning: a measurement option)
            if vt == 16:
                live = t < end
                rows = tl.where(blk, vrow0 + shift + tt, vtail + t - nb * G)
                acc = _full_value_step(acc, p, vfull_ptr, 0, tl.where(live, rows, 0), live, dd, D, DOT)
        m_i = m_new
    _store_split(outp_ptr, lsep_ptr, (s64 * tl.num_programs(1) + sp) * M, acc, zs, m_i, l_i, mrow, crow, qok, dd,
                 D, GV)  # fmt: skip


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def supported(query: torch.Tensor, layout: BlockLayout, keys: BlockedSide, values: BlockedSide) -> bool:
    """Whether the kernel takes the cache: float16 or bfloat16, power-of-two head dim of at least 16, power-of-two
    block ``G >= 16`` dividing it (values per token in channel groups of ``G``), tiers 4 / 2 / 1 only."""
    D, G = keys.head_dim, layout.block
    return (
        keys.dtype in (torch.float16, torch.bfloat16)
        and values.dtype == keys.dtype
        and _pow2(D)
        and D >= 16
        and _pow2(G)
        and G >= 16
        and D % G == 0
        and values.group_size == G
        and keys.axis == "channel"
        and values.axis == "token"
        and set(keys.tiers) <= set(QUANT)
        and set(values.tiers) <= set(QUANT)
    )


def _tier_args(side: BlockedSide, device, dtype) -> list:
    """Codes, scales and zeros of tiers 4, 2, 1 (empty stand-ins for an absent tier, never read) and the 1-bit
    codebook (float32 ``[2]``)."""
    args = []
    for b in QUANT:
        t = side.tiers.get(b)
        if t is None:
            args += [torch.zeros(1, dtype=torch.uint8, device=device)] + [
                torch.zeros(1, dtype=dtype, device=device)
            ] * 2
        else:
            args += [t.codes.contiguous(), t.scales.contiguous(), t.zeros.contiguous()]
    one = side.tiers.get(1)
    cb = one.codebook if one is not None and one.codebook is not None else torch.tensor([0.0, 1.0])
    return args + [cb.to(device=device, dtype=torch.float32)]


def blocked_decode_v2_triton(
    query: torch.Tensor,
    layout: BlockLayout,
    keys: BlockedSide,
    values: BlockedSide,
    scale: float,
    *,
    tiles: int | None = None,
    num_warps: int = 4,
    tensor_cores: bool | None = None,
    asm: bool | None = None,
    key_split: bool = True,
    full_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kv_hqekv.kernels.folded.blocked_decode_v2_ref`: ``(out float32 [B, Hq, Q, D], lse float32
    [B, Hq, Q])``. ``ValueError`` for a cache it does not take (:func:`supported`). ``tiles`` blocks per program
    (default :func:`~kvcodec.kernels.triton_attention.split_plan`); ``tensor_cores``, ``asm``, ``key_split`` as
    :func:`kvcodec.kernels.triton_decode_v2.kivi_decode_v2_triton`. ``full_rows=False`` compiles the full-precision
    branches out (wrong for any cache that holds full rows: a measurement option, ``benchmarks/sm90_decode_v2_tiers.py``
    counts the folded tiles alone with it)."""
    if not supported(query, layout, keys, values):
        raise ValueError(
            "blocked_decode_v2_triton needs a float16/bfloat16 cache, a power-of-two head dim and block G >= 16 "
            f"dividing it, tiers 4/2/1; got {keys.dtype}, D={keys.head_dim}, G={layout.block}, tiers "
            f"{sorted(keys.tiers)}/{sorted(values.tiers)} (kv_hqekv.kernels.folded.blocked_decode_v2_ref takes any)"
        )
    B, Hq, Q, D = query.shape
    H = layout.blocks.shape[1]
    S, M = B * H, Hq // H * Q
    T, G = layout.width, layout.block
    dev = query.device
    if S == 0 or M == 0 or T == 0:
        out = torch.zeros(B, Hq, Q, D, dtype=torch.float32, device=dev)
        return out, torch.full((B, Hq, Q), float("-inf"), dtype=torch.float32, device=dev)
    _, tiles, nsplit = split_plan(T, S, G, tiles)
    half = query.is_cuda if tensor_cores is None else bool(tensor_cores)
    asm = query.is_cuda if asm is None else bool(asm)
    C = D // G
    MB = triton.next_power_of_2(M)
    rows = max(16, C * MB)
    q = query.reshape(S, M, D).contiguous()
    dot = dot_mode(q, (keys.dtype,), True) if half and q.dtype == keys.dtype else 0
    NB = keys.tier.shape[-1]
    one = torch.zeros(1, dtype=torch.int32, device=dev)

    def maps(x):  # a [B, H, NB] block map (one element where no block is held: never read)
        return x.contiguous() if x.numel() else one.to(x.dtype)

    kgrp = keys.group if keys.group is not None else keys.row
    outp = torch.empty(S, nsplit, M, D, dtype=torch.float32, device=dev)
    lsep = torch.empty(S, nsplit, M, dtype=torch.float32, device=dev)
    _blocked_v2_kernel[(S, nsplit)](
        q, outp, lsep, keys.full.contiguous(), values.full.contiguous(),
        *_tier_args(keys, dev, keys.dtype), *_tier_args(values, dev, values.dtype),
        maps(keys.tier), maps(keys.row), maps(kgrp), maps(values.tier), maps(values.row),
        keys.tail.contiguous(), values.tail.contiguous(), layout.blocks.contiguous(), layout.held.contiguous(),
        NB, layout.appended, M, float(scale),
        D=D, G=G, GV=G, MB=MB, ROWS=rows, TILES=tiles, DOT=dot, HALF=half, ASM=asm, KSPLIT=key_split,
        K4=4 in keys.tiers, K2=2 in keys.tiers, K1=1 in keys.tiers,
        V4=4 in values.tiers, V2=2 in values.tiers, V1=1 in values.tiers, FULL=full_rows,
        num_warps=num_warps,
    )  # fmt: skip
    out, lse = merge_splits(outp, lsep, num_warps)
    return out.view(B, H, Hq // H, Q, D).reshape(B, Hq, Q, D), lse.view(B, Hq, Q)
