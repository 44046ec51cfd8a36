"""Fused Triton kernel for the HubKV refinement (paper §3.3, Eqs. 6–10, 13; Appendix A.1, E).

Design
------
The score tensor is viewed as ``R = prod(leading dims)`` rows of ``H`` heads (one row = one layer,
or one layer × batch row), each cut into ``C`` chunks of ``BLOCK_N`` tokens. Three launches:

1. *statistics* — one program per (row, chunk) holds a ``[BLOCK_H, BLOCK_N]`` tile
   (``BLOCK_H = next_pow2(H)``) and writes per-head partial count, mean, centred sum of squares,
   min, max of the unprotected scores, and a count of non-finite scores;
2. *heads* — one program per row merges its ``C`` partials exactly
   (``M2 = Σ M2_c + Σ n_c (μ_c − μ)²``), clamps ``σ`` to half the range as in
   :mod:`kv_hubkv.selectivity`, and computes ``c = σ/(μ+ε)``, ``c̄``, ``β = clip((c/c̄)^τ, β_min,
   β_max)`` and the two mixing factors ``(1-λ) + λβ`` (hub) and ``(1-λ) + λβγ`` (non-hub); it also
   writes the row's largest unprotected ``z`` (the first maximum of a head is a hub and ``s >= 0``,
   so that is ``max s · factor_hub``) and an error flag;
3. *mixing* — one program per (row, chunk): masked one-sided max-pools over the ``k`` left and
   ``k`` right neighbours (protected neighbours read as ``-inf``; left strict / right non-strict
   comparison gives the lowest-index tie-break, see :mod:`kv_hubkv.hubs`), then the SMD discount,
   head weight and ratio gate as one multiply (``z = s·((1-λ) + λβq)``, q ∈ {1, γ}; App. J.3); the
   protected score ``P`` (:mod:`kv_hubkv.ceiling`) comes from the rows' maxima, so it is written in
   the same pass. Neighbour loads re-read the tile's halo, which is cache-resident.

The (row, chunk) grid fills the GPU even for one layer at batch 1, where one program per row (the
first version of this kernel) left most multiprocessors idle. Value checks (finite scores,
non-negative unprotected scores) are folded into the statistics: the launcher reads the flags back
with its only host synchronisation and raises the reference's ``ValueError`` before returning.
No loop in any kernel has a run-time bound, which keeps them runnable in Triton 3.6's interpreter
with NumPy >= 2.5.

Under ``TRITON_INTERPRET=1`` the launcher also runs on CPU tensors (that is how the tests compare it
with :func:`kv_hubkv.reference.refine_torch`); everything is computed in float32 (no ``tl.dot``).
"""

from __future__ import annotations

import torch

from .checks import NEGATIVE_MSG, NONFINITE_MSG, prepare
from .config import HubKVConfig

try:  # triton is an optional extra: `pip install kv-hubkv[triton]`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

HAS_TRITON = triton is not None

__all__ = ["HAS_TRITON", "refine_triton", "refine_triton_config"]


if HAS_TRITON:

    @triton.jit
    def _hubkv_stats_kernel(
        s_ptr,
        p_ptr,
        st_ptr,
        H,
        N,
        C,
        RC,
        s_sr,
        s_sh,
        s_sn,
        p_sr,
        p_sh,
        p_sn,
        HAS_PROT: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # one program per (row, chunk): partial statistics of the chunk's unprotected scores
        pid = tl.program_id(0).to(tl.int64)
        row = pid // C
        chunk = pid % C
        offs_h = tl.arange(0, BLOCK_H)
        offs_n = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        hmask = offs_h < H
        valid = hmask[:, None] & (offs_n[None, :] < N)
        x = tl.load(s_ptr + row * s_sr + offs_h[:, None] * s_sh + offs_n[None, :] * s_sn, mask=valid, other=0.0).to(
            tl.float32
        )
        if HAS_PROT:
            pr = tl.load(p_ptr + row * p_sr + offs_h[:, None] * p_sh + offs_n[None, :] * p_sn, mask=valid, other=1)
            u = valid & (pr == 0)
        else:
            u = valid
        nb = tl.sum(u.to(tl.float32), axis=1)
        mb = tl.sum(tl.where(u, x, 0.0), axis=1) / tl.maximum(nb, 1.0)
        d = tl.where(u, x - mb[:, None], 0.0)
        m2b = tl.sum(d * d, axis=1)
        lo = tl.min(tl.where(u, x, float("inf")), axis=1)
        hi = tl.max(tl.where(u, x, float("-inf")), axis=1)
        # non-finite anywhere (protected included; NaN fails every comparison)
        bad = tl.sum((valid & ~(tl.abs(x) < float("inf"))).to(tl.float32), axis=1)
        base = st_ptr + pid * BLOCK_H + offs_h
        tl.store(base, nb)
        tl.store(base + RC * BLOCK_H, mb)
        tl.store(base + 2 * RC * BLOCK_H, m2b)
        tl.store(base + 3 * RC * BLOCK_H, lo)
        tl.store(base + 4 * RC * BLOCK_H, hi)
        tl.store(base + 5 * RC * BLOCK_H, bad)

    @triton.jit
    def _hubkv_head_kernel(
        st_ptr,
        fac_ptr,
        rowmax_ptr,
        flag_ptr,
        H,
        C,
        RC,
        gamma,
        tau,
        zero_pow,
        beta_min,
        beta_max,
        lam,
        one_minus_lam,
        eps,
        BLOCK_H: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # one program per row: merge the chunks' statistics, head selectivity (Eqs. 8-9), factors
        row = tl.program_id(0).to(tl.int64)
        offs_c = tl.arange(0, BLOCK_C)
        offs_h = tl.arange(0, BLOCK_H)
        cm = offs_c < C
        m = cm[:, None] & (offs_h[None, :] < BLOCK_H)
        idx = (row * C + offs_c[:, None]) * BLOCK_H + offs_h[None, :]
        nb = tl.load(st_ptr + idx, mask=m, other=0.0)
        mb = tl.load(st_ptr + RC * BLOCK_H + idx, mask=m, other=0.0)
        m2b = tl.load(st_ptr + 2 * RC * BLOCK_H + idx, mask=m, other=0.0)
        lo = tl.min(tl.load(st_ptr + 3 * RC * BLOCK_H + idx, mask=m, other=float("inf")), axis=0)
        hi = tl.max(tl.load(st_ptr + 4 * RC * BLOCK_H + idx, mask=m, other=float("-inf")), axis=0)
        bad = tl.sum(tl.sum(tl.load(st_ptr + 5 * RC * BLOCK_H + idx, mask=m, other=0.0), axis=1), axis=0)
        # exact parallel merge: M2 = sum M2_c + sum n_c (mean_c - mean)^2
        cnt = tl.sum(nb, axis=0)
        mean = tl.sum(nb * mb, axis=0) / tl.maximum(cnt, 1.0)
        dm = mb - mean[None, :]
        m2 = tl.sum(m2b + nb * dm * dm, axis=0)
        hmask = offs_h < H
        # population std, clamped to half the range (Popoviciu): exactly 0 on constant heads
        std = tl.minimum(tl.sqrt(m2 / tl.maximum(cnt, 1.0)), tl.where(cnt > 0, (hi - lo) * 0.5, 0.0))
        c = std / (mean + eps)
        hvalid = hmask & (cnt > 0)
        n_valid = tl.sum(hvalid.to(tl.float32), axis=0)
        cbar = tl.sum(tl.where(hvalid, c, 0.0), axis=0) / tl.maximum(n_valid, 1.0)
        rel = tl.where(cbar > 0, c / tl.where(cbar > 0, cbar, 1.0), 1.0)
        powv = tl.where(rel > 0, tl.exp2(tau * tl.log2(tl.maximum(rel, 1e-30))), zero_pow)
        beta = tl.minimum(tl.maximum(powv, beta_min), beta_max)
        fac_hub = one_minus_lam + lam * beta
        fac_non = one_minus_lam + lam * (beta * gamma)
        tl.store(fac_ptr + row * 2 * BLOCK_H + offs_h, fac_hub)
        tl.store(fac_ptr + row * 2 * BLOCK_H + BLOCK_H + offs_h, fac_non)
        # largest unprotected z of the row: the first maximum of a head is a hub and s >= 0, so it is
        # hi * fac_hub, the same float32 product the mixing kernel computes there
        tl.store(rowmax_ptr + row, tl.max(tl.where(hvalid, hi * fac_hub, float("-inf")), axis=0))
        # error flags: 1 = a non-finite score, 2 = a negative unprotected score
        neg = tl.sum((hvalid & (lo < 0)).to(tl.float32), axis=0)
        tl.store(flag_ptr + row, tl.where(bad > 0, 1, tl.where(neg > 0, 2, 0)).to(tl.int32))

    @triton.jit
    def _next_up(v):
        # nextafter(v, +inf) for finite v >= 1 (positive normal float32): add one ulp to the bit pattern
        return (v.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)

    @triton.jit
    def _hubkv_mix_kernel(
        s_ptr,
        p_ptr,
        out_ptr,
        fac_ptr,
        rowmax_ptr,
        H,
        N,
        C,
        R,
        s_sr,
        s_sh,
        s_sn,
        p_sr,
        p_sh,
        p_sn,
        o_sr,
        o_sh,
        K: tl.constexpr,
        HAS_PROT: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        # one program per (row, chunk): hubs (Eq. 6), SMD (Eq. 7), calibration + gate (Eqs. 9-10)
        pid = tl.program_id(0).to(tl.int64)
        row = pid // C
        chunk = pid % C
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_n = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = hmask[:, None] & (offs_n[None, :] < N)
        s_base = s_ptr + row * s_sr + offs_h[:, None] * s_sh
        p_base = p_ptr + row * p_sr + offs_h[:, None] * p_sh
        x = tl.load(s_base + offs_n[None, :] * s_sn, mask=valid, other=0.0).to(tl.float32)
        if HAS_PROT:
            pr = tl.load(p_base + offs_n[None, :] * p_sn, mask=valid, other=1)
            u = valid & (pr == 0)
        else:
            u = valid
        left = tl.full((BLOCK_H, BLOCK_N), float("-inf"), tl.float32)
        right = tl.full((BLOCK_H, BLOCK_N), float("-inf"), tl.float32)
        for j in tl.static_range(1, K + 1):
            il = offs_n - j
            ml = hmask[:, None] & (il[None, :] >= 0) & (il[None, :] < N)
            xl = tl.load(s_base + il[None, :] * s_sn, mask=ml, other=float("-inf")).to(tl.float32)
            ir = offs_n + j
            mr = hmask[:, None] & (ir[None, :] < N)
            xr = tl.load(s_base + ir[None, :] * s_sn, mask=mr, other=float("-inf")).to(tl.float32)
            if HAS_PROT:
                pl = tl.load(p_base + il[None, :] * p_sn, mask=ml, other=1)
                xl = tl.where(pl == 0, xl, float("-inf"))
                pq = tl.load(p_base + ir[None, :] * p_sn, mask=mr, other=1)
                xr = tl.where(pq == 0, xr, float("-inf"))
            left = tl.maximum(left, xl)
            right = tl.maximum(right, xr)
        # left strict / right non-strict: the lowest index wins ties (see kv_hubkv.hubs)
        hub = (x > left) & (x >= right)
        fac_hub = tl.load(fac_ptr + row * 2 * BLOCK_H + offs_h)
        fac_non = tl.load(fac_ptr + row * 2 * BLOCK_H + BLOCK_H + offs_h)
        # z = (1-λ)s + λβs̃ in the factorised form s·((1-λ) + λβq), q ∈ {1, γ} (App. J.3)
        z = x * tl.where(hub, fac_hub[:, None], fac_non[:, None])
        # protected score P (Eq. 13, kv_hubkv.ceiling): 1, or the next float above the call's max z
        offs_r = tl.arange(0, BLOCK_R)
        zmax = tl.max(tl.load(rowmax_ptr + offs_r, mask=offs_r < R, other=float("-inf")), axis=0)
        ceiling = tl.where(zmax >= 1.0, _next_up(zmax), 1.0)
        tl.store(out_ptr + row * o_sr + offs_h[:, None] * o_sh + offs_n[None, :], tl.where(u, z, ceiling), mask=valid)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _default_block_n(n: int, block_h: int, device: torch.device) -> int:
    if device.type != "cuda":
        # interpreter: cost ~ ops x programs, so one chunk per row
        return _next_pow2(n)
    # ~4k scores per program: enough work per program, and (rows x chunks) programs fill the GPU
    return max(16, min(_next_pow2(n), max(16, 4096 // block_h)))


def refine_triton_config(
    scores: torch.Tensor,
    ratio: float,
    protected: torch.Tensor | None,
    config: HubKVConfig,
    *,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """:func:`refine_triton` with a ready :class:`HubKVConfig`.

    Three launches over ``R = prod(leading dims)`` rows of ``H`` heads cut into ``C`` chunks of
    ``block_n`` tokens: partial statistics per (row, chunk); per row, the merged statistics, head
    selectivity and mixing factors; then hubs and mixing per (row, chunk). Value checks (finite,
    non-negative) are folded into the statistics and read back with one synchronisation at the end.

    Parameters
    ----------
    block_n : int, optional
        Tokens per program (power of two). Default: ``next_pow2(N)`` off-GPU (the interpreter),
        ``4096 // next_pow2(H)`` on CUDA.
    num_warps : int, default 4
        Warps per program on CUDA.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: pip install 'kv-hubkv[triton]' (or use refine_torch)")
    scores, prot, r = prepare(scores, ratio, protected, config, values=False)
    shape = scores.shape
    if scores.numel() == 0:
        return torch.empty(shape, dtype=torch.float32, device=scores.device)
    H, N = shape[-2], shape[-1]
    s3 = scores.reshape(-1, H, N)
    R = s3.shape[0]
    dev = scores.device
    block_h = _next_pow2(H)
    bn = block_n if block_n is not None else _default_block_n(N, block_h, dev)
    if bn < 1 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two >= 1, got {bn}")
    C = triton.cdiv(N, bn)
    out = torch.empty((R, H, N), dtype=torch.float32, device=dev)
    stats = torch.empty((6, R * C, block_h), dtype=torch.float32, device=dev)
    fac = torch.empty((R, 2, block_h), dtype=torch.float32, device=dev)
    rowmax = torch.empty((R,), dtype=torch.float32, device=dev)
    flags = torch.empty((R,), dtype=torch.int32, device=dev)
    if prot is not None:
        p3 = prot.reshape(-1, H, N).view(torch.uint8)
        p_strides = p3.stride()
    else:
        p3 = out  # never read (HAS_PROT=False)
        p_strides = (0, 0, 0)
    lam = config.gate(r)
    _hubkv_stats_kernel[(R * C,)](
        s3,
        p3,
        stats,
        H,
        N,
        C,
        R * C,
        *s3.stride(),
        *p_strides,
        HAS_PROT=prot is not None,
        BLOCK_H=block_h,
        BLOCK_N=bn,
        num_warps=num_warps,
    )
    _hubkv_head_kernel[(R,)](
        stats,
        fac,
        rowmax,
        flags,
        H,
        C,
        R * C,
        config.gamma,
        config.tau,
        1.0 if config.tau == 0 else 0.0,
        config.beta_min,
        config.beta_max,
        lam,
        1.0 - lam,
        config.eps,
        BLOCK_H=block_h,
        BLOCK_C=_next_pow2(C),
        num_warps=1 if dev.type != "cuda" else 4,
    )
    _hubkv_mix_kernel[(R * C,)](
        s3,
        p3,
        out,
        fac,
        rowmax,
        H,
        N,
        C,
        R,
        *s3.stride(),
        *p_strides,
        out.stride(0),
        out.stride(1),
        K=config.half_window,
        HAS_PROT=prot is not None,
        BLOCK_H=block_h,
        BLOCK_N=bn,
        BLOCK_R=_next_pow2(R),
        num_warps=num_warps,
    )
    flag = int(flags.max())  # the one host synchronisation
    if flag:
        raise ValueError(NONFINITE_MSG if flag == 1 else NEGATIVE_MSG)
    return out.reshape(shape)


def refine_triton(
    scores: torch.Tensor,
    ratio: float,
    protected: torch.Tensor | None = None,
    *,
    kernel_size: int = 5,
    gamma: float = 0.5,
    tau: float = 0.5,
    beta_min: float = 0.8,
    beta_max: float = 1.2,
    p: float = 2.0,
    eps: float = 1e-6,
) -> torch.Tensor:
    """HubKV score refinement, fused Triton kernel (same signature and result as ``refine_torch``).

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.

    Parameters
    ----------
    scores, ratio, protected, kernel_size, gamma, tau, beta_min, beta_max, p, eps
        See :func:`kv_hubkv.refine`.

    Returns
    -------
    torch.Tensor
        float32 refined scores, same shape as ``scores``.

    Raises
    ------
    RuntimeError
        If triton is not installed.
    """
    config = HubKVConfig(
        kernel_size=kernel_size, gamma=gamma, tau=tau, beta_min=beta_min, beta_max=beta_max, p=p, eps=eps
    )
    return refine_triton_config(scores, ratio, protected, config)
