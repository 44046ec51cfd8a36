"""Triton kernel: gather the kept entries of a ragged per-head selection into one flat buffer.

``compact(x [B, H, T, D], keep [B, H, T]) -> (flat [N, D], lengths [B, H])`` with rows in ``(b, h, t)``
row-major order, exactly ``x[keep]`` (the reference). The destination of every kept row is an exclusive
prefix sum of ``keep`` (one ``torch.cumsum``); the kernel then moves ``BLOCK_R`` rows x the whole head
dimension per program, reading ``x`` through its strides (no copy of a non-contiguous input).

This module needs ``triton``; import it lazily (``kvcodec.kernels.dispatch`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _compact_kernel(
    x_ptr,
    keep_ptr,
    dst_ptr,
    out_ptr,
    R,
    H,
    T,
    sb,
    sh,
    st,
    sd,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = rows < R
    kept = tl.load(keep_ptr + rows, mask=rmask, other=0) != 0
    rmask = rmask & kept
    dst = tl.load(dst_ptr + rows, mask=rmask, other=0)
    b = rows // (H * T)
    h = (rows // T) % H
    t = rows % T
    src = b * sb + h * sh + t * st
    cols = tl.arange(0, BLOCK_D)
    m = rmask[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + src[:, None] + cols[None, :].to(tl.int64) * sd, mask=m)
    tl.store(out_ptr + dst[:, None] * D + cols[None, :], x, mask=m)


def compact_triton(
    x: torch.Tensor, keep: torch.Tensor, *, block_rows: int | None = None, num_warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton :func:`~kvcodec.kernels.reference.compact_ref`."""
    B, H, T, D = x.shape
    flat_keep = keep.reshape(-1).contiguous()
    lengths = keep.sum(-1)
    dst = torch.cumsum(flat_keep, 0) - flat_keep.long()
    n = int(lengths.sum())
    out = torch.empty(n, D, dtype=x.dtype, device=x.device)
    R = B * H * T
    if n == 0:
        return out, lengths
    block_d = max(1, 1 << (D - 1).bit_length())
    br = block_rows if block_rows is not None else max(1, min(1 << (R - 1).bit_length(), max(1, 4096 // block_d)))
    br = 1 << (br - 1).bit_length()
    sb, sh, st, sd = x.stride()
    _compact_kernel[(triton.cdiv(R, br),)](
        x,
        flat_keep.view(torch.uint8),
        dst,
        out,
        R,
        H,
        T,
        sb,
        sh,
        st,
        sd,
        D=D,
        BLOCK_R=br,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out, lengths
