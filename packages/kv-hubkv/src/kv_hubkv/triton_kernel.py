"""Fused Triton kernel for the HubKV refinement (paper §3.3, Eqs. 6–10, 13; Appendix A.1, E).

Design
------
The score tensor is viewed as ``R = prod(leading dims)`` rows of ``H`` heads (one row = one layer,
or one layer × batch row), each cut into ``C`` chunks of ``BLOCK_N`` tokens. **Two launches over a (row, chunk)
grid**, each program holding one ``[BLOCK_H, BLOCK_N]`` tile (``BLOCK_H = next_pow2(H)``):

1. *chunk statistics* (first launch) — per head, count, mean and centred sum of squares of the chunk's
   unprotected scores, min, max and a count of non-finite scores, written to the workspace's partials;
2. *row statistics and head factors* (second launch, every program of a row alike) — the row's partials merged in
   one step (``M2 = Σ M2_c + Σ n_c (μ_c - μ)²``), ``σ`` clamped to half the range as in
   :mod:`kv_hubkv.selectivity`, ``c = σ/(μ+ε)``, ``c̄``, ``β = clip((c/c̄)^τ, β_min, β_max)`` and the two mixing
   factors ``(1-λ) + λβ`` (hub) and ``(1-λ) + λβγ`` (non-hub); the row's largest unprotected ``z`` (the first
   maximum of a head is a hub and ``s >= 0``, so that is ``max s · factor_hub``); the value checks raise the
   workspace's error flag (:mod:`kv_hubkv.workspace`) with an atomic max -- no host synchronisation in the kernel;
3. *mixing* of the program's chunk — masked one-sided max-pools over the ``k`` left and ``k`` right neighbours
   (protected neighbours read as ``-inf``; left strict / right non-strict comparison gives the lowest-index
   tie-break, see :mod:`kv_hubkv.hubs`), then the SMD discount, head weight and ratio gate as one multiply
   (``z = s·((1-λ) + λβq)``, q ∈ {1, γ}; App. J.3); protected entries get 1. For hub windows up to 5 (``k <= 2``,
   the paper's default) the chunk is read as quads of consecutive entries: a neighbour is one of the quad's own
   entries, split out of registers, or one of the two entries before / after it, read by two 2-entry halo loads
   per quad. Reloading the tile shifted by each of the ``2k`` neighbour offsets, for the scores and the protection
   flags, compiled to ~160 scalar 8- and 16-bit loads per thread on sm_90 (the unshifted tile: 6 vector loads),
   so the pass was bound by load instructions, not bytes;
4. *protected score* ``P`` (:mod:`kv_hubkv.ceiling`) — every program increments a completion counter
   (acquire/release); the last one reads every row's maximum, resets the counter for the next call and,
   only if that maximum reached 1 (then ``P`` is the next float above it), rewrites the protected
   entries of every row. With scores below ``1 / β_max``-ish (attention weights) that path never runs.

History, measured on GPUs (docs/benchmarks.md): three launches over this grid with a host synchronisation (the
per-call cost dominated, H100), then one launch of one program per row and then this grid with a serial last pass
(the last program rewrote every protected score whenever a refined score reached 1): 0.1-3.0 ms kernels at Table 5
shapes on an H200, the same whatever the grid. Scratch (partials, head factors, counters, the call's maximum, flag)
lives in a reusable :class:`~kv_hubkv.workspace.RefineWorkspace`; :class:`kv_hubkv.Refiner` adds
deferred checks and CUDA graphs. No loop in the kernels has a run-time bound (chunk and row counts are
compile-time constants), which keeps them runnable in Triton 3.6's interpreter with NumPy >= 2.5.

Under ``TRITON_INTERPRET=1`` the launcher also runs on CPU tensors (that is how the tests compare it
with :func:`kv_hubkv.reference.refine_torch`); everything is computed in float32 (no ``tl.dot``).
"""

from __future__ import annotations

import torch

from .checks import prepare
from .config import HubKVConfig
from .workspace import NEG_INF_KEY, RefineWorkspace

try:  # triton is an optional extra: `pip install kv-hubkv[triton]`
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

HAS_TRITON = triton is not None

__all__ = ["HAS_TRITON", "NEG_INF_KEY", "RefineWorkspace", "refine_triton", "refine_triton_config"]


if HAS_TRITON:

    @triton.jit
    def _next_up(v):
        # nextafter(v, +inf) for finite v >= 1 (positive normal float32): add one ulp to the bit pattern
        return (v.to(tl.int32, bitcast=True) + 1).to(tl.float32, bitcast=True)

    @triton.jit
    def _order_key(v):
        # float32 -> int32 whose signed order is the float order (non-negative floats keep their bits, negative
        # ones flip the 31 low bits)
        b = v.to(tl.int32, bitcast=True)
        return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)

    @triton.jit
    def _from_order_key(k):
        return tl.where(k >= 0, k, k ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)

    @triton.jit
    def _chunk_tile(
        s_ptr,
        p_ptr,
        row,
        c,
        H,
        N,
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
        # chunk c of row `row`, every head: the head and entry offsets, the in-range mask, the heads' score and
        # protection base pointers, the scores (float32, 0 out of range) and the unprotected in-range mask
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_n = c * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = hmask[:, None] & (offs_n[None, :] < N)
        s_base = s_ptr + row * s_sr + offs_h[:, None] * s_sh
        p_base = p_ptr + row * p_sr + offs_h[:, None] * p_sh
        x = tl.load(s_base + offs_n[None, :] * s_sn, mask=valid, other=0.0).to(tl.float32)
        if HAS_PROT:
            pr = tl.load(p_base + offs_n[None, :] * p_sn, mask=valid, other=1)
            u = valid & (pr == 0)
        else:
            u = valid
        return offs_h, hmask, offs_n, valid, s_base, p_base, x, u

    @triton.jit
    def _chunk_stats_combine(n0, s0, lo0, hi0, b0, n1, s1, lo1, hi1, b1):
        return n0 + n1, s0 + s1, tl.minimum(lo0, lo1), tl.maximum(hi0, hi1), b0 + b1

    @triton.jit
    def _mixed(x, u, left, right, fac_hub, fac_non, ceiling):
        # left strict / right non-strict: the lowest index wins ties (see kv_hubkv.hubs); z = (1-λ)s + λβs̃ in the
        # factorised form s·((1-λ) + λβq), q ∈ {1, γ} (App. J.3); protected entries get the ceiling
        hub = (x > left) & (x >= right)
        return tl.where(u, x * tl.where(hub, fac_hub, fac_non), ceiling)

    @triton.jit
    def _quad_load(s_ptr, p_ptr, s_off, p_off, idx, ok, HAS_PROT: tl.constexpr):
        # scores at idx (float32) and whether each is an unprotected entry in range (-inf-able neighbour)
        x = tl.load(s_ptr + s_off + idx, mask=ok, other=0.0).to(tl.float32)
        if HAS_PROT:
            ok = ok & (tl.load(p_ptr + p_off + idx, mask=ok, other=1) == 0)
        return x, ok

    @triton.jit
    def _quarters(t, BLOCK_H: tl.constexpr, NQ: tl.constexpr):
        # [.., NQ, 4] quads -> their entries 0, 1, 2, 3 as four [.., NQ] tensors, split out of registers:
        # [.., 4] -> [.., 2, 2] (entry 2a + b) -> split b -> split a
        t02, t13 = tl.split(tl.reshape(t, (BLOCK_H, NQ, 2, 2)))
        t0, t2 = tl.split(t02)
        t1, t3 = tl.split(t13)
        return t0, t1, t2, t3

    @triton.jit
    def _mix_quads(
        s_ptr, p_ptr, out_ptr, row, c, H, N, s_sr, s_sh, p_sr, p_sh, o_sr, o_sh, fac_hub, fac_non, ceiling,
        K: tl.constexpr, HAS_PROT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # The chunk as [BLOCK_H, BLOCK_N / 4, 4] quads of consecutive entries (one vector load / store each where
        # aligned). Entry 4q + i's neighbours within [-2, +2] are the quad's own entries (split out of registers)
        # or the two before / after it (two 2-entry halo loads per quad), never a shifted reload of the whole
        # tile (K shifted scalar loads per side of scores and of protection flags, which dominated the kernel).
        NQ: tl.constexpr = BLOCK_N // 4
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        q0 = c * BLOCK_N + tl.arange(0, NQ) * 4
        s_off = row * s_sr + offs_h[:, None, None] * s_sh
        p_off = row * p_sr + offs_h[:, None, None] * p_sh
        h3 = hmask[:, None, None]
        i4 = q0[None, :, None] + tl.arange(0, 4)[None, None, :]
        x4, u4 = _quad_load(s_ptr, p_ptr, s_off, p_off, i4, h3 & (i4 < N), HAS_PROT)
        ip = q0[None, :, None] + tl.arange(0, 2)[None, None, :] - 2  # entries 4q - 2, 4q - 1
        xp, up = _quad_load(s_ptr, p_ptr, s_off, p_off, ip, h3 & (ip >= 0) & (ip < N), HAS_PROT)
        inx = q0[None, :, None] + tl.arange(0, 2)[None, None, :] + 4  # entries 4q + 4, 4q + 5
        xn, un = _quad_load(s_ptr, p_ptr, s_off, p_off, inx, h3 & (inx < N), HAS_PROT)
        # neighbours read as -inf where protected or out of range
        nb4 = tl.where(u4, x4, float("-inf"))
        pm2, pm1 = tl.split(tl.where(up, xp, float("-inf")))
        n0, n1 = tl.split(tl.where(un, xn, float("-inf")))
        e0, e1, e2, e3 = _quarters(nb4, BLOCK_H, NQ)
        x0, x1, x2, x3 = _quarters(x4, BLOCK_H, NQ)
        u0, u1, u2, u3 = _quarters(u4, BLOCK_H, NQ)
        if K == 0:  # no neighbour: every entry is its window's maximum
            none = tl.full(x0.shape, float("-inf"), tl.float32)
            o0 = _mixed(x0, u0, none, none, fac_hub, fac_non, ceiling)
            o1 = _mixed(x1, u1, none, none, fac_hub, fac_non, ceiling)
            o2 = _mixed(x2, u2, none, none, fac_hub, fac_non, ceiling)
            o3 = _mixed(x3, u3, none, none, fac_hub, fac_non, ceiling)
        elif K == 1:
            o0 = _mixed(x0, u0, pm1, e1, fac_hub, fac_non, ceiling)
            o1 = _mixed(x1, u1, e0, e2, fac_hub, fac_non, ceiling)
            o2 = _mixed(x2, u2, e1, e3, fac_hub, fac_non, ceiling)
            o3 = _mixed(x3, u3, e2, n0, fac_hub, fac_non, ceiling)
        else:
            o0 = _mixed(x0, u0, tl.maximum(pm1, pm2), tl.maximum(e1, e2), fac_hub, fac_non, ceiling)
            o1 = _mixed(x1, u1, tl.maximum(e0, pm1), tl.maximum(e2, e3), fac_hub, fac_non, ceiling)
            o2 = _mixed(x2, u2, tl.maximum(e1, e0), tl.maximum(e3, n0), fac_hub, fac_non, ceiling)
            o3 = _mixed(x3, u3, tl.maximum(e2, e1), tl.maximum(n0, n1), fac_hub, fac_non, ceiling)
        # join(join(o0, o2), join(o1, o3)) is [.., 2, 2] with [a, b] = entry 2a + b: back to quads
        out4 = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), (BLOCK_H, NQ, 4))
        tl.store(out_ptr + row * o_sr + offs_h[:, None, None] * o_sh + i4, out4, mask=h3 & (i4 < N))

    @triton.jit
    def _hubkv_stats_kernel(
        s_ptr,
        p_ptr,
        part_ptr,
        fac_ptr,
        rowcount_ptr,
        zmax_ptr,
        flag_ptr,
        H,
        N,
        C,
        s_sr,
        s_sh,
        s_sn,
        p_sr,
        p_sh,
        p_sn,
        gamma,
        tau,
        zero_pow,
        beta_min,
        beta_max,
        lam,
        one_minus_lam,
        eps,
        HAS_PROT: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        # program (row, chunk): per head, the chunk's count, mean, centred sum of squares, min and max of the
        # unprotected scores and its count of non-finite scores -> part[row, chunk, 0:6, :]; the row's last chunk
        # to finish merges them into the row's head factors -> fac[row, 0:2, :]
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs_h, hmask, _offs_n, valid, _s_base, _p_base, x, u = _chunk_tile(
            s_ptr, p_ptr, row, c, H, N, s_sr, s_sh, s_sn, p_sr, p_sh, p_sn, HAS_PROT, BLOCK_H, BLOCK_N
        )
        # count, sum, min, max and non-finite count (protected included; NaN fails every comparison) in one
        # reduction of five operands (one exchange between warps where five separate reductions made five), then
        # the centred sum of squares around the chunk's mean
        nb, sb, lo, hi, bad = tl.reduce(
            (
                u.to(tl.float32),
                tl.where(u, x, 0.0),
                tl.where(u, x, float("inf")),
                tl.where(u, x, float("-inf")),
                (valid & ~(tl.abs(x) < float("inf"))).to(tl.float32),
            ),
            1,
            _chunk_stats_combine,
        )
        mb = sb / tl.maximum(nb, 1.0)
        d = tl.where(u, x - mb[:, None], 0.0)
        base = part_ptr + ((row * BLOCK_C + c) * 6) * BLOCK_H + offs_h
        tl.store(base, nb)
        tl.store(base + BLOCK_H, mb)
        tl.store(base + 2 * BLOCK_H, tl.sum(d * d, axis=1))
        tl.store(base + 3 * BLOCK_H, lo)
        tl.store(base + 4 * BLOCK_H, hi)
        tl.store(base + 5 * BLOCK_H, bad)
        # the row's last chunk (release/acquire on the row's counter orders the other chunks' partials before it)
        done = tl.atomic_add(rowcount_ptr + row, 1, sem="acq_rel")
        if done == C - 1:
            tl.atomic_xchg(rowcount_ptr + row, 0)  # reset for the next call
            # the row's statistics in one step (Chan et al.'s parallel formula: M2 = sum M2_c + sum n_c dmean_c^2)
            offs_c = tl.arange(0, BLOCK_C)
            cmask = (offs_c < C)[:, None] & hmask[None, :]
            pb = part_ptr + ((row * BLOCK_C + offs_c[:, None]) * 6) * BLOCK_H + offs_h[None, :]
            nc = tl.load(pb, mask=cmask, other=0.0)
            mc = tl.load(pb + BLOCK_H, mask=cmask, other=0.0)
            m2c = tl.load(pb + 2 * BLOCK_H, mask=cmask, other=0.0)
            cnt = tl.sum(nc, axis=0)
            mean = tl.sum(nc * mc, axis=0) / tl.maximum(cnt, 1.0)
            dm = tl.where(nc > 0, mc - mean[None, :], 0.0)
            m2 = tl.sum(m2c, axis=0) + tl.sum(nc * dm * dm, axis=0)
            lo = tl.min(tl.load(pb + 3 * BLOCK_H, mask=cmask, other=float("inf")), axis=0)
            hi = tl.max(tl.load(pb + 4 * BLOCK_H, mask=cmask, other=float("-inf")), axis=0)
            bad = tl.sum(tl.load(pb + 5 * BLOCK_H, mask=cmask, other=0.0), axis=0)
            # head selectivity (Eqs. 8-9) and mixing factors; population std clamped to half the range
            # (Popoviciu): exactly 0 on constant heads
            std = tl.minimum(tl.sqrt(m2 / tl.maximum(cnt, 1.0)), tl.where(cnt > 0, (hi - lo) * 0.5, 0.0))
            cv = std / (mean + eps)
            hvalid = hmask & (cnt > 0)
            n_valid = tl.sum(hvalid.to(tl.float32), axis=0)
            cbar = tl.sum(tl.where(hvalid, cv, 0.0), axis=0) / tl.maximum(n_valid, 1.0)
            rel = tl.where(cbar > 0, cv / tl.where(cbar > 0, cbar, 1.0), 1.0)
            powv = tl.where(rel > 0, tl.exp2(tau * tl.log2(tl.maximum(rel, 1e-30))), zero_pow)
            beta = tl.minimum(tl.maximum(powv, beta_min), beta_max)
            fac_hub = one_minus_lam + lam * beta
            tl.store(fac_ptr + row * 2 * BLOCK_H + offs_h, fac_hub)
            tl.store(fac_ptr + (row * 2 + 1) * BLOCK_H + offs_h, one_minus_lam + lam * (beta * gamma))
            # error flag (sticky until read): 1 = a non-finite score, 2 = a negative unprotected score
            neg = tl.sum((hvalid & (lo < 0)).to(tl.float32), axis=0)
            nonfinite = tl.sum(bad, axis=0)
            tl.atomic_max(flag_ptr, tl.where(nonfinite > 0, 1, tl.where(neg > 0, 2, 0)).to(tl.int32))
            # largest unprotected z of the call: the first maximum of a head is a hub and s >= 0, so a row's is
            # hi * fac_hub, the same float32 product the mixing computes there; kept as an order-preserving int32
            # key (an integer atomic max, which the interpreter supports too)
            tl.atomic_max(zmax_ptr, _order_key(tl.max(tl.where(hvalid, hi * fac_hub, float("-inf")), axis=0)))

    @triton.jit
    def _hubkv_mix_kernel(
        s_ptr,
        p_ptr,
        out_ptr,
        fac_ptr,
        count_ptr,
        zmax_ptr,
        H,
        N,
        R,
        C,
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
        QUADS: tl.constexpr,
    ):
        # program (row, chunk): hubs (Eq. 6), SMD (Eq. 7), calibration + gate (Eqs. 9-10) of the chunk with the row's
        # head factors; protected entries get the call's protected score P (Eq. 13, kv_hubkv.ceiling): 1, or the
        # next float above the call's largest z when that reached 1
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        offs_h = tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        fac_hub = tl.load(fac_ptr + row * 2 * BLOCK_H + offs_h)[:, None]
        fac_non = tl.load(fac_ptr + (row * 2 + 1) * BLOCK_H + offs_h)[:, None]
        zmax = _from_order_key(tl.load(zmax_ptr))
        ceiling = tl.where(zmax >= 1.0, _next_up(tl.maximum(zmax, 1.0)), 1.0)
        if QUADS:  # K <= 2: neighbours from the tile's own registers plus a 2-entry halo per quad (module doc)
            _mix_quads(
                s_ptr, p_ptr, out_ptr, row, c, H, N, s_sr, s_sh, p_sr, p_sh, o_sr, o_sh, fac_hub, fac_non, ceiling,
                K, HAS_PROT, BLOCK_H, BLOCK_N,
            )  # fmt: skip
        else:
            offs_h, hmask, offs_n, valid, s_base, p_base, x, u = _chunk_tile(
                s_ptr, p_ptr, row, c, H, N, s_sr, s_sh, s_sn, p_sr, p_sh, p_sn, HAS_PROT, BLOCK_H, BLOCK_N
            )
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
            out = _mixed(x, u, left, right, fac_hub, fac_non, ceiling)
            tl.store(out_ptr + row * o_sr + offs_h[:, None] * o_sh + offs_n[None, :], out, mask=valid)
        # the last program of the call (every program read zmax before its release increment) resets the call's
        # maximum and the counter for the next call
        done = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if done == R * C - 1:
            tl.atomic_xchg(count_ptr, 0)
            tl.atomic_xchg(zmax_ptr, -2139095041)  # workspace.NEG_INF_KEY: -inf


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


#: programs a CUDA launch aims for when it picks the chunk length (two waves on a 132-multiprocessor GPU)
TARGET_PROGRAMS = 264


def _default_block_n(n: int, block_h: int, rows: int, device: torch.device) -> int:
    if device.type != "cuda":
        # interpreter: cost ~ ops x programs, so one chunk per row
        return _next_pow2(n)
    # enough (row, chunk) programs to fill the GPU, at most ~8k scores per [BLOCK_H, BLOCK_N] tile
    want = _next_pow2(max(1, -(-n * rows // TARGET_PROGRAMS)))
    return max(16, min(_next_pow2(n), max(16, 8192 // block_h), max(256, want)))


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
    quad_path: bool | None = None,
) -> torch.Tensor:
    """:func:`refine_triton` with a ready :class:`HubKVConfig`.

    Two launches over a (row, chunk) grid (``R = prod(leading dims)`` rows of ``H`` heads, ``block_n``-token
    chunks): the chunks' statistics, then the row's statistics merged from them, the head factors and the mixing of
    each chunk, and the protected score of the call by the last program to finish. Argument checks (types, shapes,
    ratio) run on the host and need no synchronisation; the value checks (finite, non-negative unprotected scores)
    are folded into the kernels and land in the workspace's error flag.

    Parameters
    ----------
    block_n : int, optional
        Tokens per chunk (power of two). Default: ``next_pow2(N)`` off-GPU (the interpreter); on CUDA the
        length that gives about :data:`TARGET_PROGRAMS` programs, between 256 and ``8192 // next_pow2(H)``.
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
    quad_path : bool, optional
        The mixing reads each chunk as quads of consecutive entries and finds the hub neighbours in registers
        (module doc) where it can: hub windows up to 5 (``kernel_size <= 5``), ``block_n >= 4``, entries contiguous
        along the tokens (``None``, default); always (``True``: ``ValueError`` where it cannot) or never
        (``False``: shifted reloads of the tile per neighbour, the earlier form, kept as a baseline).
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: pip install 'kv-hubkv[triton]' (or use refine_torch)")
    if check not in ("eager", "deferred"):
        raise ValueError(f"check must be 'eager' or 'deferred', got {check!r}")
    if quad_path is not None and not isinstance(quad_path, bool):
        raise TypeError(f"quad_path must be None, True or False, got {quad_path!r}")
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
    bn = block_n if block_n is not None else _default_block_n(N, block_h, R, dev)
    if bn < 1 or bn & (bn - 1):
        raise ValueError(f"block_n must be a power of two >= 1, got {bn}")
    C = triton.cdiv(N, bn)
    block_c = _next_pow2(C)
    ws = RefineWorkspace() if workspace is None else workspace
    rowcount, count, flag, zmax = ws.buffers(R, dev)
    n_part = R * block_c * 6 * block_h
    scratch = ws.partials(n_part + R * 2 * block_h, dev)
    part, fac = scratch[:n_part], scratch[n_part:]
    o3 = out.view(R, H, N)
    if prot is not None:
        p3 = prot.reshape(-1, H, N).view(torch.uint8)
        p_strides = p3.stride()
    else:
        p3 = o3  # never read (HAS_PROT=False)
        p_strides = (0, 0, 0)
    lam = config.gate(r)
    warps = num_warps  # (the interpreter ignores it)
    # the quad path needs entries contiguous along N (scores, protection, output) and whole quads per chunk
    quads = (
        (quad_path if quad_path is not None else True)
        and config.half_window <= 2
        and bn >= 4
        and s3.stride(2) == 1
        and (prot is None or p3.stride(2) == 1)
    )
    if quad_path and not quads:
        raise ValueError(
            f"quad_path=True needs kernel_size <= 5, block_n >= 4 and scores / protection contiguous along the "
            f"tokens; got kernel_size {config.kernel_size}, block_n {bn}, score strides {tuple(s3.stride())}"
        )
    _hubkv_stats_kernel[(R, C)](
        s3,
        p3,
        part,
        fac,
        rowcount,
        zmax,
        flag,
        H,
        N,
        C,
        *s3.stride(),
        *p_strides,
        config.gamma,
        config.tau,
        1.0 if config.tau == 0 else 0.0,
        config.beta_min,
        config.beta_max,
        lam,
        1.0 - lam,
        config.eps,
        HAS_PROT=prot is not None,
        BLOCK_H=block_h,
        BLOCK_N=bn,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    _hubkv_mix_kernel[(R, C)](
        s3,
        p3,
        o3,
        fac,
        count,
        zmax,
        H,
        N,
        R,
        C,
        *s3.stride(),
        *p_strides,
        o3.stride(0),
        o3.stride(1),
        K=config.half_window,
        HAS_PROT=prot is not None,
        BLOCK_H=block_h,
        BLOCK_N=bn,
        QUADS=quads,
        num_warps=warps,
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
