"""Fused Triton kernel for the HubKV refinement (paper §3.3, Eqs. 6–10, 13; Appendix A.1, E).

Design
------
The score tensor is viewed as ``R = prod(leading dims)`` rows of ``H`` heads (one row = one layer,
or one layer × batch row). **One launch**, one program per row, holding ``[BLOCK_H, BLOCK_N]`` tiles
(``BLOCK_H = next_pow2(H)``) of the row's chunks in turn:

1. *statistics* — per head, count, mean and centred sum of squares of the unprotected scores merged
   chunk by chunk (``M2 = M2_a + M2_b + δ² n_a n_b / n``), min, max and a count of non-finite scores;
2. *head factors* — ``σ`` clamped to half the range as in :mod:`kv_hubkv.selectivity`, ``c = σ/(μ+ε)``,
   ``c̄``, ``β = clip((c/c̄)^τ, β_min, β_max)`` and the two mixing factors ``(1-λ) + λβ`` (hub) and
   ``(1-λ) + λβγ`` (non-hub); the row's largest unprotected ``z`` (the first maximum of a head is a hub
   and ``s >= 0``, so that is ``max s · factor_hub``); the value checks raise the workspace's error flag
   (:mod:`kv_hubkv.workspace`) with an atomic max -- no host synchronisation in the kernel;
3. *mixing* — masked one-sided max-pools over the ``k`` left and ``k`` right neighbours (protected
   neighbours read as ``-inf``; left strict / right non-strict comparison gives the lowest-index
   tie-break, see :mod:`kv_hubkv.hubs`), then the SMD discount, head weight and ratio gate as one
   multiply (``z = s·((1-λ) + λβq)``, q ∈ {1, γ}; App. J.3); protected entries get 1;
4. *protected score* ``P`` (:mod:`kv_hubkv.ceiling`) — every program increments a completion counter
   (acquire/release); the last one reads every row's maximum, resets the counter for the next call and,
   only if that maximum reached 1 (then ``P`` is the next float above it), rewrites the protected
   entries of every row. With scores below ``1 / β_max``-ish (attention weights) that path never runs.

The previous version used three launches over a (row, chunk) grid (statistics, heads, mixing) and a host
synchronisation to read the error flags; its per-call cost (launches, allocations, sync) dominated at
the paper's Table 5 shapes. Scratch (row maxima, counter, flag) lives in a reusable
:class:`~kv_hubkv.workspace.RefineWorkspace`; :class:`kv_hubkv.Refiner` adds deferred checks and CUDA
graphs. No loop in the kernel has a run-time bound (chunk and row counts are compile-time constants),
which keeps it runnable in Triton 3.6's interpreter with NumPy >= 2.5.

Under ``TRITON_INTERPRET=1`` the launcher also runs on CPU tensors (that is how the tests compare it
with :func:`kv_hubkv.reference.refine_torch`); everything is computed in float32 (no ``tl.dot``).
"""

from __future__ import annotations

import torch

from .checks import prepare
from .config import HubKVConfig
from .workspace import RefineWorkspace

try:  # triton is an optional extra: `pip install kv-hubkv[triton]`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

HAS_TRITON = triton is not None

__all__ = ["HAS_TRITON", "RefineWorkspace", "refine_triton", "refine_triton_config"]


if HAS_TRITON:

    @triton.jit
    def _next_up(v):
        # nextafter(v, +inf) for finite v >= 1 (positive normal float32): add one ulp to the bit pattern
        return (v.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)

    @triton.jit
    def _hubkv_refine_kernel(
        s_ptr,
        p_ptr,
        out_ptr,
        rowmax_ptr,
        count_ptr,
        flag_ptr,
        H,
        N,
        R,
        s_sr,
        s_sh,
        s_sn,
        p_sr,
        p_sh,
        p_sn,
        o_sr,
        o_sh,
        gamma,
        tau,
        zero_pow,
        beta_min,
        beta_max,
        lam,
        one_minus_lam,
        eps,
        K: tl.constexpr,
        HAS_PROT: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNKS: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        # one program per row (one launch): statistics pass, head factors, mixing pass, then the last program to
        # finish fixes the protected score P if some unprotected z of the call reached 1
        row = tl.program_id(0).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        s_base = s_ptr + row * s_sr + offs_h[:, None] * s_sh
        p_base = p_ptr + row * p_sr + offs_h[:, None] * p_sh
        # -- 1. statistics of the unprotected scores, merged chunk by chunk (Chan et al.'s parallel update) --
        cnt = tl.zeros((BLOCK_H,), tl.float32)
        mean = tl.zeros((BLOCK_H,), tl.float32)
        m2 = tl.zeros((BLOCK_H,), tl.float32)
        lo = tl.full((BLOCK_H,), float("inf"), tl.float32)
        hi = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        bad = tl.zeros((BLOCK_H,), tl.float32)
        for c in range(CHUNKS):
            offs_n = c * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = hmask[:, None] & (offs_n[None, :] < N)
            x = tl.load(s_base + offs_n[None, :] * s_sn, mask=valid, other=0.0).to(tl.float32)
            if HAS_PROT:
                pr = tl.load(p_base + offs_n[None, :] * p_sn, mask=valid, other=1)
                u = valid & (pr == 0)
            else:
                u = valid
            nb = tl.sum(u.to(tl.float32), axis=1)
            mb = tl.sum(tl.where(u, x, 0.0), axis=1) / tl.maximum(nb, 1.0)
            d = tl.where(u, x - mb[:, None], 0.0)
            m2b = tl.sum(d * d, axis=1)
            tot = cnt + nb
            delta = mb - mean
            w = nb / tl.maximum(tot, 1.0)
            mean = mean + delta * w
            m2 = m2 + m2b + delta * delta * cnt * w
            cnt = tot
            lo = tl.minimum(lo, tl.min(tl.where(u, x, float("inf")), axis=1))
            hi = tl.maximum(hi, tl.max(tl.where(u, x, float("-inf")), axis=1))
            # non-finite anywhere (protected included; NaN fails every comparison)
            bad += tl.sum((valid & ~(tl.abs(x) < float("inf"))).to(tl.float32), axis=1)
        # -- 2. head selectivity (Eqs. 8-9) and mixing factors --
        # population std, clamped to half the range (Popoviciu): exactly 0 on constant heads
        std = tl.minimum(tl.sqrt(m2 / tl.maximum(cnt, 1.0)), tl.where(cnt > 0, (hi - lo) * 0.5, 0.0))
        cv = std / (mean + eps)
        hvalid = hmask & (cnt > 0)
        n_valid = tl.sum(hvalid.to(tl.float32), axis=0)
        cbar = tl.sum(tl.where(hvalid, cv, 0.0), axis=0) / tl.maximum(n_valid, 1.0)
        rel = tl.where(cbar > 0, cv / tl.where(cbar > 0, cbar, 1.0), 1.0)
        powv = tl.where(rel > 0, tl.exp2(tau * tl.log2(tl.maximum(rel, 1e-30))), zero_pow)
        beta = tl.minimum(tl.maximum(powv, beta_min), beta_max)
        fac_hub = one_minus_lam + lam * beta
        fac_non = one_minus_lam + lam * (beta * gamma)
        # error flag (sticky until read): 1 = a non-finite score, 2 = a negative unprotected score
        neg = tl.sum((hvalid & (lo < 0)).to(tl.float32), axis=0)
        nonfinite = tl.sum(bad, axis=0)
        code = tl.where(nonfinite > 0, 1, tl.where(neg > 0, 2, 0)).to(tl.int32)
        tl.atomic_max(flag_ptr, code)
        # -- 3. hubs (Eq. 6), SMD (Eq. 7), calibration + gate (Eqs. 9-10); protected entries get 1 for now --
        for c in range(CHUNKS):
            offs_n = c * BLOCK_N + tl.arange(0, BLOCK_N)
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
            # left strict / right non-strict: the lowest index wins ties (see kv_hubkv.hubs)
            hub = (x > left) & (x >= right)
            # z = (1-λ)s + λβs̃ in the factorised form s·((1-λ) + λβq), q ∈ {1, γ} (App. J.3)
            z = x * tl.where(hub, fac_hub[:, None], fac_non[:, None])
            tl.store(out_ptr + row * o_sr + offs_h[:, None] * o_sh + offs_n[None, :], tl.where(u, z, 1.0), mask=valid)
        # largest unprotected z of the row: the first maximum of a head is a hub and s >= 0, so it is
        # hi * fac_hub, the same float32 product the mixing pass computes there
        tl.store(rowmax_ptr + row, tl.max(tl.where(hvalid, hi * fac_hub, float("-inf")), axis=0))
        # -- 4. protected score P (Eq. 13, kv_hubkv.ceiling): 1, or the next float above the call's max z --
        # the last program to finish (release/acquire on the counter orders every row's stores before it) reads
        # every row's maximum, resets the counter for the next call and, only if that maximum reached 1,
        # rewrites the protected entries of every row
        done = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if done == R - 1:
            tl.atomic_xchg(count_ptr, 0)
            offs_r = tl.arange(0, BLOCK_R)
            zmax = tl.max(tl.load(rowmax_ptr + offs_r, mask=offs_r < R, other=float("-inf")), axis=0)
            if HAS_PROT:  # noqa: SIM102 (a compile-time branch around a run-time one)
                if zmax >= 1.0:
                    ceiling = _next_up(zmax)
                    for r in range(BLOCK_R):
                        rr = (offs_h * 0 + r).to(tl.int64)  # the row, as a tensor (both back ends)
                        rmask = hmask & (rr < R)
                        for c in range(CHUNKS):
                            offs_n = c * BLOCK_N + tl.arange(0, BLOCK_N)
                            valid = rmask[:, None] & (offs_n[None, :] < N)
                            pr = tl.load(
                                p_ptr + rr[:, None] * p_sr + offs_h[:, None] * p_sh + offs_n[None, :] * p_sn,
                                mask=valid,
                                other=0,
                            )
                            tl.store(
                                out_ptr + rr[:, None] * o_sr + offs_h[:, None] * o_sh + offs_n[None, :],
                                tl.zeros((BLOCK_H, BLOCK_N), tl.float32) + ceiling,
                                mask=valid & (pr != 0),
                            )


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _default_block_n(n: int, block_h: int, device: torch.device) -> int:
    if device.type != "cuda":
        # interpreter: cost ~ ops x iterations, so one chunk per row
        return _next_pow2(n)
    # ~8k scores per tile: a [BLOCK_H, BLOCK_N] tile per loop iteration
    return max(16, min(_next_pow2(n), max(16, 8192 // block_h)))


def refine_triton_config(
    scores: torch.Tensor,
    ratio: float,
    protected: torch.Tensor | None,
    config: HubKVConfig,
    *,
    block_n: int | None = None,
    num_warps: int = 8,
    workspace: RefineWorkspace | None = None,
    check: str = "eager",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`refine_triton` with a ready :class:`HubKVConfig`.

    One launch of one program per row (``R = prod(leading dims)`` rows of ``H`` heads): the statistics pass, the
    head factors and the mixing pass over ``block_n``-token chunks, then the protected score of the call by the
    last program to finish. Argument checks (types, shapes, ratio) run on the host and need no synchronisation;
    the value checks (finite, non-negative unprotected scores) are folded into the kernel and land in the
    workspace's error flag.

    Parameters
    ----------
    block_n : int, optional
        Tokens per loop iteration (power of two). Default: ``next_pow2(N)`` off-GPU (the interpreter),
        ``8192 // next_pow2(H)`` on CUDA.
    num_warps : int, default 8
        Warps per program on CUDA.
    workspace : RefineWorkspace, optional
        Reused scratch (row maxima, completion counter, error flag); a fresh one per call if omitted.
    check : {"eager", "deferred"}
        ``"eager"``: read the error flag before returning (one host synchronisation) and raise the reference's
        ``ValueError``. ``"deferred"``: no synchronisation; the flag stays set in ``workspace`` until
        :meth:`RefineWorkspace.raise_if_error` reads it (the returned scores are then unspecified).
    out : torch.Tensor, optional
        float32 contiguous output of the scores' shape to write into (a preallocated buffer).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: pip install 'kv-hubkv[triton]' (or use refine_torch)")
    if check not in ("eager", "deferred"):
        raise ValueError(f"check must be 'eager' or 'deferred', got {check!r}")
    scores, prot, r = prepare(scores, ratio, protected, config, values=False)
    shape = scores.shape
    dev = scores.device
    if out is None:
        out = torch.empty(shape, dtype=torch.float32, device=dev)
    elif not (
        isinstance(out, torch.Tensor)
        and out.shape == shape
        and out.dtype == torch.float32
        and out.device == dev
        and out.is_contiguous()
    ):
        raise ValueError(f"out must be a contiguous float32 tensor of shape {tuple(shape)} on {dev}")
    if scores.numel() == 0:
        return out
    H, N = shape[-2], shape[-1]
    s3 = scores.reshape(-1, H, N)
    R = s3.shape[0]
    block_h = _next_pow2(H)
    bn = block_n if block_n is not None else _default_block_n(N, block_h, dev)
    if bn < 1 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two >= 1, got {bn}")
    ws = RefineWorkspace() if workspace is None else workspace
    rowmax, count, flag = ws.buffers(R, dev)
    o3 = out.view(R, H, N)
    if prot is not None:
        p3 = prot.reshape(-1, H, N).view(torch.uint8)
        p_strides = p3.stride()
    else:
        p3 = o3  # never read (HAS_PROT=False)
        p_strides = (0, 0, 0)
    lam = config.gate(r)
    _hubkv_refine_kernel[(R,)](
        s3,
        p3,
        o3,
        rowmax,
        count,
        flag,
        H,
        N,
        R,
        *s3.stride(),
        *p_strides,
        o3.stride(0),
        o3.stride(1),
        config.gamma,
        config.tau,
        1.0 if config.tau == 0 else 0.0,
        config.beta_min,
        config.beta_max,
        lam,
        1.0 - lam,
        config.eps,
        K=config.half_window,
        HAS_PROT=prot is not None,
        BLOCK_H=block_h,
        BLOCK_N=bn,
        CHUNKS=triton.cdiv(N, bn),
        BLOCK_R=_next_pow2(R),
        num_warps=num_warps if dev.type == "cuda" else 1,
    )
    if check == "eager":
        ws.raise_if_error()
    return out


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
