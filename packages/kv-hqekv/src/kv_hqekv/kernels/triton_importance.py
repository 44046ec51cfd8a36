"""Triton kernels: HqeKV window importance (§3.2, Alg. 2 l.5-9) tiled, never materialising more than a tile.

``A[b, j] = Σ_{h ∈ Hq} Σ_i softmax_j(q_i·k_j/√d + causal mask) / c_j`` over the ``m`` window queries. Two passes over
the keys, each over tiles of ``BLOCK_N`` keys, with the ``Hq/Hkv · m`` window rows of one KV head in registers
(``m = 20``: 80 rows for Llama-8B's GQA groups of 4):

1. the log-sum-exp of every window row, online (split over the keys; the splits' partial maxima and sums are
   combined on the host);
2. ``Σ_rows exp(logit - lse)`` for every key of the tile, written once per (KV head, key).

The ``[B, Hkv, N]`` per-head sums are added over KV heads and divided by ``c_j`` on the host. Logits are float32:
``tl.dot`` on the matrix units in the cache dtype when queries and keys share float16 or bfloat16 (exact products,
float32 accumulation, :mod:`kvcodec.kernels.triton_dot`), else IEEE float32 (no TF32). Keys are dense ``[B, Hkv, N,
D]`` or, for a re-plan, read straight from a store's block layout (``MAPPED``: each key dequantized in registers
from its tier, :mod:`kv_hqekv.kernels.blocked`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kv_hqekv.kernels.blocked import BlockedSide, BlockLayout
from kv_hqekv.kernels.reference import seen_by
from kv_hqekv.kernels.triton_tiles import OUT_CODE, _block_maps, _dummies, _mapped_rows, side_args
from kvcodec.kernels.alignment import rows_aligned
from kvcodec.kernels.triton_dot import as_dot, dot_mode, qk_dot


@triton.jit
def _window_logits(q, k_ptr, b, h, seg, n0, skb, skh, skn, skd, valid_ptr, N, M_WIN, sqrt_d, r, rmask, d, dmask,
                   kt, kr, kg, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1, KC, KPW4, KPW2, KPW1,
                   nb, hl, ktail, A, NB,
                   HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr, MAPPED: tl.constexpr, G: tl.constexpr,
                   KGROUP_IS_ROW: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, KGCOL: tl.constexpr,
                   KHAS4: tl.constexpr, KHAS2: tl.constexpr, KHAS1: tl.constexpr, KCB4: tl.constexpr,
                   KCB2: tl.constexpr, KCB1: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr,
                   DOT: tl.constexpr):  # fmt: skip
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < N
    if MAPPED:  # keys dequantized in registers from the held codes (kv_hqekv.kernels.blocked), slot n of head b·H+h
        kti, kri, kgi = _block_maps(kt, kr, kg, ktail, seg, n, nb, hl, A, NB, G, KGROUP_IS_ROW)
        k = _mapped_rows(
            kti, kri, kgi, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1,
            d, dmask, KC, KPW4, KPW2, KPW1, D, KGCOL, BLOCK_N, BLOCK_D,
            KHAS4, KHAS2, KHAS1, KCB4, KCB2, KCB1, FMAX, OUT,
        )  # fmt: skip
    else:
        koff = b.to(tl.int64) * skb + h.to(tl.int64) * skh + n.to(tl.int64) * skn
        k = tl.load(
            k_ptr + koff[:, None] + d[None, :].to(tl.int64) * skd, mask=nmask[:, None] & dmask[None, :], other=0.0
        ).to(tl.float32)
    logits = tl.math.div_rn(qk_dot(q, k, DOT), sqrt_d)
    i = r % M_WIN
    see = (n[None, :] <= (N - M_WIN + i)[:, None]) & nmask[None, :] & rmask[:, None]
    if HAS_VALID:
        see = see & (tl.load(valid_ptr + b.to(tl.int64) * N + n, mask=nmask, other=0) != 0)[None, :]
    return tl.where(see, logits, float("-inf")), n, nmask


@triton.jit
def _load_window(q_ptr, b, h, sqb, sqh, sqm, sqd, M_WIN, GROUP: tl.constexpr, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    r = tl.arange(0, BLOCK_M)
    rmask = r < GROUP * M_WIN
    hq = h * GROUP + r // M_WIN
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    off = b.to(tl.int64) * sqb + hq.to(tl.int64) * sqh + (r % M_WIN).to(tl.int64) * sqm
    q = tl.load(q_ptr + off[:, None] + d[None, :].to(tl.int64) * sqd, mask=rmask[:, None] & dmask[None, :], other=0.0)
    return q.to(tl.float32), r, rmask, d, dmask


# the held length, the split count and the strides that follow them change at every re-plan: not specialised (an
# integer equal to 1 or divisible by 16 would compile a variant of its own, seen as a new compile at a re-plan in
# benchmarks/decode_census.py). The unit strides and the key token stride (the head dim) stay specialised.
_RUNTIME = ["sqb", "sqh", "sqm", "skb", "skh", "N", "M_WIN", "NSPLIT"]


@triton.jit(do_not_specialize=_RUNTIME + ["A"])
def _window_lse_kernel(
    q_ptr, k_ptr, valid_ptr, max_ptr, sum_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, H, N, M_WIN, NSPLIT, sqrt_d,
    kt, kr, kg, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1, KC, KPW4, KPW2, KPW1,
    nb_ptr, held_ptr, ktail_ptr, A, NB,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TILES: tl.constexpr, HAS_VALID: tl.constexpr,
    MAPPED: tl.constexpr, G: tl.constexpr, KGROUP_IS_ROW: tl.constexpr, KGCOL: tl.constexpr,
    KHAS4: tl.constexpr, KHAS2: tl.constexpr, KHAS1: tl.constexpr, KCB4: tl.constexpr, KCB2: tl.constexpr,
    KCB1: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr, DOT: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // H
    h = pid % H
    if ALIGNED:  # the host checked these run-time strides are multiples of 16: `x // 16 * 16` tells the compiler
        sqb, sqh, sqm, skb, skh = sqb // 16 * 16, sqh // 16 * 16, sqm // 16 * 16, skb // 16 * 16, skh // 16 * 16
    seg = pid.to(tl.int64)
    q, r, rmask, d, dmask = _load_window(q_ptr, b, h, sqb, sqh, sqm, sqd, M_WIN, GROUP, D, BLOCK_M, BLOCK_D)
    q = as_dot(q, DOT)
    nb, hl, ktail = _head_layout(nb_ptr, held_ptr, ktail_ptr, seg, MAPPED)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for t in range(TILES):
        n0 = (sp * TILES + t) * BLOCK_N
        logits, _, _ = _window_logits(
            q, k_ptr, b, h, seg, n0, skb, skh, skn, skd, valid_ptr, N, M_WIN, sqrt_d, r, rmask, d, dmask,
            kt, kr, kg, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1, KC, KPW4, KPW2, KPW1,
            nb, hl, ktail, A, NB, HAS_VALID, BLOCK_N, MAPPED, G, KGROUP_IS_ROW, D, BLOCK_D, KGCOL,
            KHAS4, KHAS2, KHAS1, KCB4, KCB2, KCB1, FMAX, OUT, DOT,
        )  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(logits, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(logits - m_safe[:, None]), axis=1)
        m_i = m_new
    part = (pid.to(tl.int64) * NSPLIT + sp) * (GROUP * M_WIN) + r
    tl.store(max_ptr + part, m_i, mask=rmask)
    tl.store(sum_ptr + part, l_i, mask=rmask)


@triton.jit(do_not_specialize=[n for n in _RUNTIME if n != "NSPLIT"] + ["A"])
def _window_sum_kernel(
    q_ptr, k_ptr, valid_ptr, lse_ptr, out_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, H, N, M_WIN, sqrt_d,
    kt, kr, kg, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1, KC, KPW4, KPW2, KPW1,
    nb_ptr, held_ptr, ktail_ptr, A, NB,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TILES: tl.constexpr, HAS_VALID: tl.constexpr,
    MAPPED: tl.constexpr, G: tl.constexpr, KGROUP_IS_ROW: tl.constexpr, KGCOL: tl.constexpr,
    KHAS4: tl.constexpr, KHAS2: tl.constexpr, KHAS1: tl.constexpr, KCB4: tl.constexpr, KCB2: tl.constexpr,
    KCB1: tl.constexpr, FMAX: tl.constexpr, OUT: tl.constexpr, DOT: tl.constexpr, ALIGNED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    b = pid // H
    h = pid % H
    if ALIGNED:  # the host checked these run-time strides are multiples of 16: `x // 16 * 16` tells the compiler
        sqb, sqh, sqm, skb, skh = sqb // 16 * 16, sqh // 16 * 16, sqm // 16 * 16, skb // 16 * 16, skh // 16 * 16
    seg = pid.to(tl.int64)
    q, r, rmask, d, dmask = _load_window(q_ptr, b, h, sqb, sqh, sqm, sqd, M_WIN, GROUP, D, BLOCK_M, BLOCK_D)
    q = as_dot(q, DOT)
    nb, hl, ktail = _head_layout(nb_ptr, held_ptr, ktail_ptr, seg, MAPPED)
    lse = tl.load(lse_ptr + pid.to(tl.int64) * (GROUP * M_WIN) + r, mask=rmask, other=float("-inf"))
    seen = lse != float("-inf")
    lse = tl.where(seen, lse, 0.0)
    for t in range(TILES):
        n0 = (sp * TILES + t) * BLOCK_N
        logits, n, nmask = _window_logits(
            q, k_ptr, b, h, seg, n0, skb, skh, skn, skd, valid_ptr, N, M_WIN, sqrt_d, r, rmask, d, dmask,
            kt, kr, kg, kf, kc4, ks4, kz4, kk4, kc2, ks2, kz2, kk2, kc1, ks1, kz1, kk1, KC, KPW4, KPW2, KPW1,
            nb, hl, ktail, A, NB, HAS_VALID, BLOCK_N, MAPPED, G, KGROUP_IS_ROW, D, BLOCK_D, KGCOL,
            KHAS4, KHAS2, KHAS1, KCB4, KCB2, KCB1, FMAX, OUT, DOT,
        )  # fmt: skip
        p = tl.where(seen[:, None], tl.exp(logits - lse[:, None]), 0.0)
        tl.store(out_ptr + pid.to(tl.int64) * N + n, tl.sum(p, axis=0), mask=nmask)


@triton.jit
def _head_layout(nb_ptr, held_ptr, ktail_ptr, seg, MAPPED: tl.constexpr):
    """The head's block count, length and first tail row of a block layout (zeros for dense keys)."""
    if MAPPED:
        nb = tl.load(nb_ptr + seg).to(tl.int64)
        hl = tl.load(held_ptr + seg).to(tl.int64)
        ktail = tl.load(ktail_ptr + seg).to(tl.int64)
    else:
        nb = seg * 0
        hl = seg * 0
        ktail = seg * 0
    return nb, hl, ktail


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << (max(n, 1) - 1).bit_length())


def window_importance_triton(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor | None = None,
    normalize: bool = True,
    *,
    block_n: int | None = None,
    tiles: int = 4,
    num_warps: int = 8,
    tensor_cores: bool | None = None,
) -> torch.Tensor:
    """Triton :func:`~kv_hqekv.importance.window_importance_ref` (same arguments, same results up to the float32
    summation order): ``block_n`` keys per tile, ``tiles`` tiles per program; ``tensor_cores`` as in
    :func:`kvcodec.kernels.triton_dot.dot_mode` (queries and keys in one half-precision dtype multiply on the matrix
    units: the products are exact and accumulate in float32)."""
    B, H, N = keys.shape[0], keys.shape[1], keys.shape[2]
    return _importance(queries, keys, None, None, B, H, N, valid, normalize, block_n, tiles, num_warps, tensor_cores)


def window_importance_blocked_triton(
    queries: torch.Tensor,
    layout: BlockLayout,
    keys: BlockedSide,
    valid: torch.Tensor | None = None,
    normalize: bool = True,
    *,
    block_n: int | None = None,
    tiles: int = 4,
    num_warps: int = 8,
    tensor_cores: bool | None = None,
) -> torch.Tensor:
    """Triton :func:`~kv_hqekv.importance.window_importance_blocked_ref`: the window importance over the keys of a
    cache addressed by blocks, each key dequantized in registers from its held tier (no key is written out)."""
    B, H = layout.blocks.shape
    return _importance(
        queries, None, layout, keys, B, H, layout.width, valid, normalize, block_n, tiles, num_warps, tensor_cores
    )


def _importance(
    queries, keys, layout, side, B, H, N, valid, normalize, block_n, tiles, num_warps, tensor_cores
) -> torch.Tensor:
    _, Hq, m, D = queries.shape
    device = queries.device
    group = Hq // H
    out = torch.zeros(B, N, dtype=torch.float32, device=device)
    if B * H * N * m == 0:
        return out
    dot = dot_mode(queries, (side.dtype if side is not None else keys.dtype,), tensor_cores)
    # 64 keys per tile on the matrix units; 16 on the IEEE float32 path (larger tiles spill there for sm_90)
    bn = _pow2(block_n if block_n is not None else (64 if dot else 16))
    nsplit = triton.cdiv(N, bn * tiles)
    S, M = B * H, group * m
    mx = torch.empty(S, nsplit, M, dtype=torch.float32, device=device)
    sm = torch.empty(S, nsplit, M, dtype=torch.float32, device=device)
    vptr = valid.to(torch.uint8).contiguous() if valid is not None else torch.zeros(1, dtype=torch.uint8, device=device)
    meta = dict(
        GROUP=group, D=D, BLOCK_M=_pow2(M), BLOCK_N=bn, BLOCK_D=_pow2(D), TILES=tiles, HAS_VALID=valid is not None
    )
    meta["DOT"] = dot
    dummy = _dummies(device)
    if side is None:  # dense keys: the side's pointers are never read
        strides = (*queries.stride(), *keys.stride())
        side_ptrs = [dummy[0], dummy[2], dummy[2], dummy[1]] + [dummy[0], dummy[1], dummy[1], dummy[1]] * 3
        side_ptrs += [1, 1, 1, 1]
        blocked = [dummy[2], dummy[2], dummy[2], 0, 0]
        meta.update(MAPPED=False, G=1, KGROUP_IS_ROW=False, KGCOL=1, FMAX=0.0, OUT=0)
        meta.update({f"K{k}{b}": False for b in (4, 2, 1) for k in ("HAS", "CB")})
        kptr = keys
    else:
        strides = (*queries.stride(), 0, 0, 0, 0)
        side_ptrs, smeta = side_args(side)
        blocked = [layout.blocks, layout.held, side.tail, layout.appended, side.tier.shape[-1]]
        meta.update(MAPPED=True, G=layout.block, FMAX=float(torch.finfo(side.dtype).max), OUT=OUT_CODE[side.dtype])
        meta.update({"K" + k: v for k, v in smeta.items()})
        kptr = dummy[1]
    # rows start 16-element aligned (the strides left unspecialised above are multiples of 16, the bases aligned):
    # the kernels then read query and key rows as vectors (on sm_90 each element was a 16-bit load of its own).
    # Matrix-unit path only: on the IEEE float32 path the hint made Triton (3.6 and 3.9) compile the kernels with
    # 32 registers and ~2.8 KB of spills per thread for sm_90 (benchmarks/sm90_resources.py --float32)
    tensors = (queries,) if side is not None else (queries, keys)
    meta["ALIGNED"] = bool(dot) and all(t.stride(-1) == 1 for t in tensors) and rows_aligned(tensors)
    sqrt_d = float(torch.tensor(math.sqrt(D), dtype=torch.float32))
    _window_lse_kernel[(S, nsplit)](
        queries, kptr, vptr, mx, sm, *strides, H, N, m, nsplit, sqrt_d, *side_ptrs, *blocked, **meta,
        num_warps=num_warps,
    )  # fmt: skip
    top = mx.amax(1)
    top_safe = torch.where(torch.isfinite(top), top, 0.0)
    total = (sm * torch.exp(mx - top_safe[:, None])).sum(1)
    lse = torch.where(total > 0, top_safe + torch.log(torch.where(total > 0, total, 1.0)), float("-inf"))
    per_head = torch.zeros(S, N, dtype=torch.float32, device=device)
    _window_sum_kernel[(S, nsplit)](
        queries, kptr, vptr, lse.contiguous(), per_head, *strides, H, N, m, sqrt_d, *side_ptrs, *blocked, **meta,
        num_warps=num_warps,
    )  # fmt: skip
    out = per_head.view(B, H, N).sum(1)
    if normalize:
        out = out / seen_by(N, m, device)
    return out
