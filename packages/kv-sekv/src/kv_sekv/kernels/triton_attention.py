"""Triton kernel of SEKV's Stage-1 decode attention with a per-entry logit bias, returning ``(out, lse)``.

Same signature and result as :func:`kv_sekv.kernels.reference.biased_attention_torch`. One program per (batch, query
head, query, split) streams a run of its KV head's entries in blocks with an online softmax (FlashAttention, Dao et
al. 2022, §3.1), and the splits are merged by log-sum-exp (Flash-Decoding: without the split a decode step ran
``B · Hq`` programs, and the block count, a compile-time constant, recompiled the kernel as the cache grew);
the dot products are elementwise products and sums in float32 (decode is memory-bound, and ``tl.dot`` on bf16 is
wrong in the interpreter). The blocks per program are a compile-time constant (the interpreter needs constant loop
bounds). Tested against the reference under ``TRITON_INTERPRET=1``; GPU speed is unmeasured (before the split,
SEKV decoded at 0.11x DynamicCache's steps/s through kv-hf on an H200).

:func:`factored_attention_batch_triton` is Stage 2 (§3.3): the attention of every expanded (span, KV head) of a
decode step over the span reconstructed from its low-rank factors, ``K̂ = U_K diag(σ_K) V_Kᵀ`` and likewise ``V̂``,
without reconstructing it: one program per (item, query row) folds the query into the key factors
(``q̃ = σ_K ⊙ (V_K q)``), streams the span's tokens in blocks (logits ``U_K q̃``, online softmax, the weights
accumulated against ``U_V``), and maps the result back once (``V_Vᵀ (σ_V ⊙ acc)``); the items of a KV head are then
merged by log-sum-exp (:func:`kv_sekv.kernels.reference.merge_items`). Items are zero-padded to one shape as in the
reference. The single-span :func:`factored_attention_triton` still runs the reference.
"""

from __future__ import annotations

import torch

from kvcodec.kernels.alignment import rows_aligned
from kvcore.checks import check_int

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "biased_attention_splits_triton",
    "biased_attention_triton",
    "factored_attention_batch_triton",
    "factored_items_triton",
    "merge_split_parts",
]

if HAS_TRITON:

    @triton.jit
    def _online_softmax_step(m, total, acc, s, rows):
        """One block of an online softmax: running max ``m``, sum ``total`` and weighted sum ``acc`` updated with
        the block's logits ``s [BLOCK_N]`` (``-inf`` on masked entries) and the rows ``[BLOCK_N, W]`` they weight."""
        m_new = tl.maximum(m, tl.max(s, 0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        corr = tl.exp(m - safe)
        w = tl.exp(s - safe)
        return m_new, total * corr + tl.sum(w, 0), acc * corr + tl.sum(w[:, None] * rows, 0)

    # the entry count and the cache's batch/head strides change as the cache grows: not specialised (an integer
    # equal to 1 or divisible by 16 would compile a variant of its own); the row strides stay (= D)
    @triton.jit(do_not_specialize=["N", "skb", "skh", "svb", "svh", "sbb", "sbh"])
    def _biased_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        b_ptr,
        o_ptr,
        lse_ptr,
        scale,
        N,
        sqb,
        sqh,
        sqq,
        skb,
        skh,
        skn,
        svb,
        svh,
        svn,
        sbb,
        sbh,
        HQ: tl.constexpr,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TILES: tl.constexpr,
        ALIGNED: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        # the host checked the key and value strides are multiples of 16 (and the bases 16-byte aligned): `x // 16 * 16`
        # (exact) tells the compiler, which then loads rows as vectors instead of one element at a time. (The bias's
        # head stride is its length, a multiple of 16 one step in 16: not hinted, or the variant would alternate.)
        if ALIGNED:
            skb = skb // 16 * 16
            skh = skh // 16 * 16
            svb = svb // 16 * 16
            svh = svh // 16 * 16
        # program (batch x query head, query, split): TILES blocks of the split's entries; partial results
        # [(pid * Q + query) * splits + split] merged by log-sum-exp on the host
        pid = tl.program_id(0)
        qi = tl.program_id(1)
        sp = tl.program_id(2)
        b = pid // HQ
        h = pid % HQ
        kh = h // GROUP
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(q_ptr + b * sqb + h * sqh + qi * sqq + d, mask=dmask, other=0.0).to(tl.float32)
        m = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), 0)
        l = tl.sum(tl.zeros((BLOCK_N,), tl.float32), 0)
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for i in range(TILES):
            n = (sp * TILES + i) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < N
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + b * skb + kh * skh + n[:, None] * skn + d[None, :], mask=kv_mask, other=0.0)
            if HAS_BIAS:
                bias = tl.load(b_ptr + b * sbb + kh * sbh + n, mask=nmask, other=float("-inf")).to(tl.float32)
            else:  # no bias: only the entries past N are masked
                bias = tl.where(nmask, 0.0, float("-inf"))
            s = tl.sum(k.to(tl.float32) * q[None, :], 1) * scale + bias
            v = tl.load(v_ptr + b * svb + kh * svh + n[:, None] * svn + d[None, :], mask=kv_mask, other=0.0)
            m, l, acc = _online_softmax_step(m, l, acc, s, v.to(tl.float32))
        has = l > 0
        out = tl.where(has, acc / tl.where(has, l, 1.0), 0.0)
        lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
        row = (pid.to(tl.int64) * tl.num_programs(1) + qi) * tl.num_programs(2) + sp
        tl.store(o_ptr + row * BLOCK_D + d, out, mask=dmask)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _factored_items_kernel(
        q_ptr, uk_ptr, sk_ptr, vk_ptr, uv_ptr, sv_ptr, vv_ptr, len_ptr, o_ptr, lse_ptr, scale,
        M: tl.constexpr, L: tl.constexpr, RK: tl.constexpr, RV: tl.constexpr, D: tl.constexpr,
        BLOCK_RK: tl.constexpr, BLOCK_RV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        N_BLOCKS: tl.constexpr,
    ):  # fmt: skip
        """Program (item p, query row m): ``out[p, m]``, ``lse[p, m]`` over the item's ``len[p]`` tokens; every
        tensor contiguous, padded to ``L`` tokens and ranks ``RK`` / ``RV``."""
        p = tl.program_id(0)
        m = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        rk = tl.arange(0, BLOCK_RK)
        rv = tl.arange(0, BLOCK_RV)
        dmask = d < D
        rkmask = rk < RK
        rvmask = rv < RV
        n_tokens = tl.load(len_ptr + p)
        q = tl.load(q_ptr + (p * M + m) * D + d, mask=dmask, other=0.0).to(tl.float32)
        vk = tl.load(vk_ptr + (p * RK + rk[:, None]) * D + d[None, :], mask=rkmask[:, None] & dmask[None, :], other=0.0)
        sk = tl.load(sk_ptr + p * RK + rk, mask=rkmask, other=0.0)
        qt = tl.sum(vk * q[None, :], 1) * sk * scale  # [BLOCK_RK]: the query in the key basis, scaled
        mx = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), 0)
        total = tl.sum(tl.zeros((BLOCK_N,), tl.float32), 0)
        acc = tl.zeros((BLOCK_RV,), tl.float32)
        for i in range(N_BLOCKS):
            n = i * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < n_tokens
            uk = tl.load(uk_ptr + (p * L + n[:, None]) * RK + rk[None, :], mask=nmask[:, None] & rkmask[None, :],
                         other=0.0)  # fmt: skip
            s = tl.where(nmask, tl.sum(uk * qt[None, :], 1), float("-inf"))
            uv = tl.load(uv_ptr + (p * L + n[:, None]) * RV + rv[None, :], mask=nmask[:, None] & rvmask[None, :],
                         other=0.0)  # fmt: skip
            mx, total, acc = _online_softmax_step(mx, total, acc, s, uv)
        sv = tl.load(sv_ptr + p * RV + rv, mask=rvmask, other=0.0)
        vv = tl.load(vv_ptr + (p * RV + rv[:, None]) * D + d[None, :], mask=rvmask[:, None] & dmask[None, :], other=0.0)
        has = total > 0
        coef = tl.where(has, acc * sv / tl.where(has, total, 1.0), 0.0)
        out = tl.sum(coef[:, None] * vv, 0)  # [BLOCK_D]
        tl.store(o_ptr + (p * M + m) * D + d, out, mask=dmask)
        tl.store(lse_ptr + p * M + m, tl.where(has, mx + tl.log(tl.where(has, total, 1.0)), float("-inf")))


#: programs a launch aims for when it picks the blocks per program (a few waves on a 100+ multiprocessor GPU)
TARGET_PROGRAMS = 256


def biased_attention_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    query: torch.Tensor,
    scale: float,
    block_n: int = 64,
    tiles: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`~kv_sekv.kernels.reference.biased_attention_torch` (same arguments and result):
    :func:`biased_attention_splits_triton`, its splits merged by one launch of kvcodec's merge kernel."""
    B, _Hkv, _N, D = keys.shape
    Hq, Q = query.shape[1], query.shape[2]
    out, lse = merge_split_parts(*biased_attention_splits_triton(keys, values, bias, query, scale, block_n, tiles))
    return out.reshape(B, Hq, Q, D), lse.reshape(B, Hq, Q)


def merge_split_parts(outp: torch.Tensor, lsep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kvcore.merge_split_attention` over ``dim=1`` of ``outp [R, S, D]`` / ``lsep [R, S]``:
    ``(out [R, D], lse [R])`` in one launch of kvcodec's merge kernel (views of the inputs when ``S = 1``)."""
    from kvcodec.kernels.triton_attention import merge_splits  # needs triton: imported where it runs

    R, S, D = outp.shape
    out, lse = merge_splits(outp.contiguous().view(R, S, 1, D), lsep.float().contiguous().view(R, S, 1))
    return out.view(R, D), lse.view(R)


def biased_attention_splits_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    query: torch.Tensor,
    scale: float,
    block_n: int = 64,
    tiles: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Stage-1 attention of :func:`biased_attention_triton` before its splits are merged: ``(outp [B·Hq·Q, S,
    D], lsep [B·Hq·Q, S])`` float32, one normalised output and log-sum-exp per split of the entries (``lse = -inf``,
    ``out = 0`` where a split saw no finite logit), rows in ``(batch, query head, query)`` order.

    The entries are split across programs (Flash-Decoding) in runs of ``tiles`` blocks of ``block_n``; ``tiles``
    defaults to the fewest (1 to 32) that keep the launch near :data:`TARGET_PROGRAMS` programs. The entry count
    is a run-time argument: a growing cache does not recompile the kernel."""
    if not HAS_TRITON:
        raise ImportError("biased_attention_triton needs triton (pip install kv-sekv[triton])")
    B, Hkv, N, D = keys.shape
    Hq, Q = query.shape[1], query.shape[2]
    # the kernel takes every stride but the last: a view of a store's growing buffer is read where it is held (a
    # `.contiguous()` here copied the whole resident cache at every step)
    k, v, q = (t if t.stride(-1) == 1 else t.contiguous() for t in (keys, values, query))
    b = k if bias is None else bias.float()  # no bias: the kernel reads none (any pointer will do)
    b = b if b.stride(-1) == 1 else b.contiguous()
    block_n = max(16, min(block_n, triton.next_power_of_2(max(N, 1))))
    rows = B * Hq * Q
    if tiles is None:
        want = -(-max(N, 1) // max(1, -(-TARGET_PROGRAMS // max(rows, 1))))
        tiles = next((t for t in (1, 2, 4, 8, 16, 32) if t * block_n >= want), 32)
    check_int("tiles", tiles, low=1)
    nsplit = max(1, triton.cdiv(max(N, 1), block_n * tiles))
    BD = triton.next_power_of_2(D)
    outp = torch.empty(rows, nsplit, BD, dtype=torch.float32, device=keys.device)
    lsep = torch.empty(rows, nsplit, dtype=torch.float32, device=keys.device)
    if rows:
        _biased_attention_kernel[(B * Hq, Q, nsplit)](
            q, k, v, b, outp, lsep, float(scale), N,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            b.stride(0), b.stride(1),
            HQ=Hq, GROUP=Hq // Hkv, D=D, BLOCK_D=BD, BLOCK_N=block_n, TILES=tiles,
            ALIGNED=rows_aligned((k, v), dims=(0, 1)), HAS_BIAS=bias is not None,
        )  # fmt: skip
    return outp[..., :D], lsep


def factored_attention_batch_triton(query, key_factors, value_factors, scale, group, groups, block_n: int = 64):
    """Triton version of :func:`~kv_sekv.kernels.reference.factored_attention_batch_torch` (same arguments and
    result; module doc)."""
    from .reference import merge_items

    _P, G, Q, _D = query.shape
    out, lse = factored_items_triton(query, key_factors, value_factors, scale, block_n)
    return merge_items(out, lse, group, groups, G, Q)


def factored_items_triton(query, key_factors, value_factors, scale, block_n: int = 64):
    """Triton version of :func:`~kv_sekv.kernels.reference.factored_items_torch` (same arguments and result): every
    item's attention over its span from the factors, one program per (item, query row), not merged."""
    if not HAS_TRITON:
        raise ImportError("factored_items_triton needs triton (pip install kv-sekv[triton])")
    from .reference import pad_items

    P, G, Q, D = query.shape
    M = G * Q
    out = torch.empty(P, M, D, dtype=torch.float32, device=query.device)
    lse = torch.empty(P, M, dtype=torch.float32, device=query.device)
    if P == 0:
        return out, lse
    Uk, sk, Vk, Uv, sv, Vv, lengths = pad_items(key_factors, value_factors, D, query.device)
    L, RK, RV = Uk.shape[1], Uk.shape[2], Uv.shape[2]
    q = query.float().reshape(P, M, D).contiguous()
    block_n = max(16, min(block_n, triton.next_power_of_2(L)))
    _factored_items_kernel[(P, M)](
        q, Uk, sk, Vk, Uv, sv, Vv, lengths.to(torch.int32), out, lse, float(scale),
        M=M, L=L, RK=RK, RV=RV, D=D, BLOCK_RK=max(16, triton.next_power_of_2(RK)),
        BLOCK_RV=max(16, triton.next_power_of_2(RV)), BLOCK_D=triton.next_power_of_2(D), BLOCK_N=block_n,
        N_BLOCKS=triton.cdiv(L, block_n),
    )  # fmt: skip
    return out, lse


def factored_attention_triton(query, key_factors, value_factors, scale):
    """No Triton kernel yet for Stage 2: the PyTorch reference (exact, on the query's device)."""
    from .reference import factored_attention_torch

    return factored_attention_torch(query, key_factors, value_factors, scale)
