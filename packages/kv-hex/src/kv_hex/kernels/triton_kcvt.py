"""Triton kernel: masked KCVT statistics (group minima and maxima over the entries not kept in full precision,
HEX §3.4-3.5), for keys (one group per channel over the segment's tokens) and values (one group per token over its
channels).

The reduction is the kernel; the scale rule and the codes are then computed as in
:func:`kv_hex.kernels.reference.kcvt_codes` (so codes, scales and zeros are bit-identical: minima and maxima are
exact). Loop bounds are ``tl.constexpr`` so it runs in Triton's interpreter. GPU speed is unmeasured.

This module needs ``triton``; :mod:`kv_hex.kernels.dispatch` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcodec.stats import minmax_scale, scale_dtype_for

__all__ = ["kcvt_codes_triton", "masked_minmax_triton"]


@triton.jit
def _minmax(
    X, USE, LO, HI,
    T: tl.constexpr, C: tl.constexpr, CHANNEL: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, NR: tl.constexpr,
):  # fmt: skip
    """One program per (group row g, block of BC groups): reduce NR tiles of BR elements along the group axis."""
    g, pid = tl.program_id(0), tl.program_id(1)
    cols = pid * BC + tl.arange(0, BC)  # the groups this program owns (channels, or tokens)
    lo = tl.full([BC], float("inf"), tl.float32)
    hi = tl.full([BC], float("-inf"), tl.float32)
    for it in range(NR):
        r = it * BR + tl.arange(0, BR)  # positions along the reduced axis (tokens, or channels)
        if CHANNEL:
            ok = (r[:, None] < T) & (cols[None, :] < C)
            off = (g * T + r[:, None]) * C + cols[None, :]
        else:
            ok = (r[:, None] < C) & (cols[None, :] < T)
            off = (g * T + cols[None, :]) * C + r[:, None]
        x = tl.load(X + off, mask=ok, other=0.0).to(tl.float32)
        use = (tl.load(USE + off, mask=ok, other=0) != 0) & ok
        lo = tl.minimum(lo, tl.min(tl.where(use, x, float("inf")), 0))
        hi = tl.maximum(hi, tl.max(tl.where(use, x, float("-inf")), 0))
    n = C if CHANNEL else T
    empty = lo == float("inf")
    tl.store(LO + g * n + cols, tl.where(empty, 0.0, lo), mask=cols < n)
    tl.store(HI + g * n + cols, tl.where(empty, 0.0, hi), mask=cols < n)


def masked_minmax_triton(x: torch.Tensor, use: torch.Tensor, axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 group minima and maxima of ``x [G, T, C]`` over ``use``: ``[G, 1, C]`` (``"channel"``) or
    ``[G, T, 1]`` (``"token"``); groups without entries give 0 (as :func:`kvcodec.minmax_stats`)."""
    G, T, C = x.shape
    channel = axis == "channel"
    n, red = (C, T) if channel else (T, C)
    lo = torch.empty(G, n, device=x.device, dtype=torch.float32)
    hi = torch.empty_like(lo)
    BR, BC = 32, 32
    grid = (G, triton.cdiv(n, BC))
    _minmax[grid](x.contiguous(), use.to(torch.int8).contiguous(), lo, hi, T, C, channel, BR, BC, triton.cdiv(red, BR))
    shape = (G, 1, C) if channel else (G, T, 1)
    return lo.view(shape), hi.view(shape)


def kcvt_codes_triton(
    x: torch.Tensor, use: torch.Tensor, bits: int, axis: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same signature and results as :func:`kv_hex.kernels.reference.kcvt_codes`, statistics reduced in Triton."""
    lo, hi = masked_minmax_triton(x, use, axis)
    sdt = scale_dtype_for(x.dtype, bits)
    scale = minmax_scale(hi - lo, bits, sdt)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"a KCVT group range is too large for {sdt} scales at bits={bits}; use float32 K/V")
    zero = lo.to(x.dtype)
    codes = torch.round((x.float() - zero.float()) / scale).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return codes, scale.to(sdt), zero
