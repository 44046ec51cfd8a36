"""Fused Triton kernel for the HubKV refinement (paper §3.3, Eqs. 6–10, 13; Appendix A.1, E).

Design
------
One program handles **all H heads of one leading index** (one layer, or one layer × batch row),
holding a ``[BLOCK_H, BLOCK_N]`` tile (``BLOCK_H = next_pow2(H)``) and looping over the sequence
in ``BLOCK_N`` blocks twice:

1. *statistics pass* — per-head count, mean, centred sum of squares, min and max of the
   unprotected scores, merged block by block with Chan's parallel-variance update (numerically
   stable; no ``E[x²] - E[x]²`` cancellation); ``σ`` is clamped to half the range as in
   :mod:`kv_hubkv.selectivity`. Then, still in registers: ``c = σ/(μ+ε)``, ``c̄`` over the
   heads, ``β = clip((c/c̄)^τ, β_min, β_max)``.
2. *mixing pass* — masked one-sided max-pools over the ``k`` left and ``k`` right neighbours
   (protected neighbours read as ``-inf``; left strict / right non-strict comparison gives the
   lowest-index tie-break, see :mod:`kv_hubkv.hubs`), then SMD discount, head weight and ratio
   gate as one multiply by a per-head factor (``z = s·((1-λ) + λβq)``, q ∈ {1, γ}; App. J.3),
   store. Neighbour loads re-read the tile's halo, which is cache-resident, so each pass streams
   the scores (and mask) once.

Because the head statistics must be complete before any token is mixed, keeping every head of a
leading index in one program avoids a second kernel and a global buffer; the price is that the
grid has only ``prod(leading dims)`` programs (36 for one Qwen3-8B prefill at B = 1, 144 at B = 4),
which leaves part of a large GPU idle for small batches. A two-phase variant (partial statistics
over ``(row, chunk)`` programs, then a mixing kernel that merges them) would fill the GPU better;
we chose the single fused kernel for simplicity and because its cost is already small next to
top-k selection (``benchmarks/bench_hubkv.py``).

The protected-token score ``P`` (:mod:`kv_hubkv.ceiling`) needs the maximum refined score of the
whole call: the main kernel writes ``1.0`` at protected positions and each program's maximum
unprotected ``z`` to a small buffer; a second, tiny kernel rewrites the protected entries only in
the rare case ``P != 1`` (reading the bool mask, writing nothing else). No host synchronisation.

Under ``TRITON_INTERPRET=1`` the launcher also runs on CPU tensors (that is how the tests compare it
with :func:`kv_hubkv.reference.refine_torch`); everything is computed in float32 (no ``tl.dot``).
"""

from __future__ import annotations

import torch

from .ceiling import retention_ceiling
from .checks import prepare
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
    def _hubkv_refine_kernel(
        s_ptr, p_ptr, out_ptr, zmax_ptr,
        H, N,
        s_sr, s_sh, s_sn,
        p_sr, p_sh, p_sn,
        o_sr, o_sh,
        gamma, tau, zero_pow, beta_min, beta_max, lam, one_minus_lam, eps,
        K: tl.constexpr,
        HAS_PROT: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        s_base = s_ptr + row * s_sr + offs_h[:, None] * s_sh
        p_base = p_ptr + row * p_sr + offs_h[:, None] * p_sh
        o_base = out_ptr + row * o_sr + offs_h[:, None] * o_sh

        # ---- pass 1: per-head count / mean / M2 over unprotected tokens (Chan merge) ----
        cnt = tl.zeros((BLOCK_H,), tl.float32)
        mean = tl.zeros((BLOCK_H,), tl.float32)
        m2 = tl.zeros((BLOCK_H,), tl.float32)
        lo = tl.full((BLOCK_H,), float("inf"), tl.float32)
        hi = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            valid = hmask[:, None] & (offs_n[None, :] < N)
            x = tl.load(s_base + offs_n[None, :] * s_sn, mask=valid, other=0.0).to(tl.float32)
            if HAS_PROT:
                pr = tl.load(p_base + offs_n[None, :] * p_sn, mask=valid, other=1)
                u = valid & (pr == 0)
            else:
                u = valid
            lo = tl.minimum(lo, tl.min(tl.where(u, x, float("inf")), axis=1))
            hi = tl.maximum(hi, tl.max(tl.where(u, x, float("-inf")), axis=1))
            nb = tl.sum(u.to(tl.float32), axis=1)
            mb = tl.sum(tl.where(u, x, 0.0), axis=1) / tl.maximum(nb, 1.0)
            d = tl.where(u, x - mb[:, None], 0.0)
            m2b = tl.sum(d * d, axis=1)
            tot = cnt + nb
            frac = tl.where(tot > 0, nb / tl.maximum(tot, 1.0), 0.0)
            delta = mb - mean
            mean = mean + delta * frac
            m2 = m2 + m2b + delta * delta * cnt * frac
            cnt = tot

        # ---- head selectivity (Eqs. 8-9) ----
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

        # ---- pass 2: hubs (Eq. 6), SMD (Eq. 7), calibration + gate (Eqs. 9-10) ----
        zmax = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            valid = hmask[:, None] & (offs_n[None, :] < N)
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
            hub = (x > left) & (x >= right)
            # z = (1-λ)s + λβs̃ in the factorised form s·((1-λ) + λβq), q ∈ {1, γ} (App. J.3)
            z = x * tl.where(hub, fac_hub[:, None], fac_non[:, None])
            tl.store(o_base + offs_n[None, :], tl.where(u, z, 1.0), mask=valid)
            zmax = tl.maximum(zmax, tl.max(tl.where(u, z, float("-inf")), axis=1))
        tl.store(zmax_ptr + row, tl.max(zmax, axis=0))

    @triton.jit
    def _hubkv_ceiling_kernel(
        p_ptr, out_ptr, ceil_ptr,
        H, N,
        p_sr, p_sh, p_sn,
        o_sr, o_sh,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        ceiling = tl.load(ceil_ptr)
        if ceiling != 1.0:  # protected entries already hold 1.0
            row = tl.program_id(0).to(tl.int64)
            offs_h = tl.arange(0, BLOCK_H)
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = (offs_h[:, None] < H) & (offs_n[None, :] < N)
            pr = tl.load(p_ptr + row * p_sr + offs_h[:, None] * p_sh + offs_n[None, :] * p_sn,
                         mask=valid, other=0)
            vals = tl.zeros((BLOCK_H, BLOCK_N), tl.float32) + ceiling
            tl.store(out_ptr + row * o_sr + offs_h[:, None] * o_sh + offs_n[None, :], vals,
                     mask=valid & (pr != 0))


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _default_block_n(n: int, block_h: int, device: torch.device) -> int:
    if device.type != "cuda":
        # interpreter: cost ~ ops x programs, so one block per row
        return _next_pow2(n)
    return max(16, min(_next_pow2(n), max(16, 4096 // block_h)))


def refine_triton_config(
    scores: torch.Tensor,
    ratio: float,
    protected: torch.Tensor | None,
    config: HubKVConfig,
    *,
    block_n: int | None = None,
    num_warps: int = 8,
) -> torch.Tensor:
    """:func:`refine_triton` with a ready :class:`HubKVConfig`.

    Parameters
    ----------
    block_n : int, optional
        Sequence block of the main kernel (power of two). Default: ``next_pow2(N)`` off-GPU (the
        interpreter), ``4096 // next_pow2(H)`` on CUDA.
    num_warps : int, default 8
        Warps per program on CUDA.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: pip install 'kv-hubkv[triton]' (or use refine_torch)")
    scores, prot, r = prepare(scores, ratio, protected, config)
    shape = scores.shape
    if scores.numel() == 0:
        return torch.empty(shape, dtype=torch.float32, device=scores.device)
    H, N = shape[-2], shape[-1]
    s3 = scores.reshape(-1, H, N)
    R = s3.shape[0]
    out = torch.empty((R, H, N), dtype=torch.float32, device=scores.device)
    zmax = torch.empty((R,), dtype=torch.float32, device=scores.device)
    if prot is not None:
        p3 = prot.reshape(-1, H, N).view(torch.uint8)
        p_strides = p3.stride()
    else:
        p3 = out  # never read (HAS_PROT=False)
        p_strides = (0, 0, 0)
    block_h = _next_pow2(H)
    bn = block_n if block_n is not None else _default_block_n(N, block_h, scores.device)
    if bn < 1 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two >= 1, got {bn}")
    lam = config.gate(r)
    _hubkv_refine_kernel[(R,)](
        s3, p3, out, zmax,
        H, N,
        *s3.stride(),
        *p_strides,
        out.stride(0), out.stride(1),
        config.gamma, config.tau, 1.0 if config.tau == 0 else 0.0,
        config.beta_min, config.beta_max, lam, 1.0 - lam, config.eps,
        K=config.half_window,
        HAS_PROT=prot is not None,
        BLOCK_H=block_h,
        BLOCK_N=bn,
        num_warps=num_warps,
    )
    if prot is not None:
        ceiling = retention_ceiling(zmax).reshape(1)
        bn_fix = bn if scores.device.type != "cuda" else max(16, min(_next_pow2(N), 8192 // block_h))
        _hubkv_ceiling_kernel[(R, triton.cdiv(N, bn_fix))](
            p3, out, ceiling,
            H, N,
            *p_strides,
            out.stride(0), out.stride(1),
            BLOCK_H=block_h,
            BLOCK_N=bn_fix,
            num_warps=4,
        )
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
    config = HubKVConfig(kernel_size=kernel_size, gamma=gamma, tau=tau, beta_min=beta_min,
                         beta_max=beta_max, p=p, eps=eps)
    return refine_triton_config(scores, ratio, protected, config)
