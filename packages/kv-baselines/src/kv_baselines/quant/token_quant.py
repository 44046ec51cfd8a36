"""Per-token min-max quantize + pack of a few rows: the value FIFO flush of a :class:`~kv_baselines.quant.KIVIStore`.

At decode time KIVI's value residual is a FIFO of ``R`` tokens; every step the oldest token of each head leaves it
and is quantized per token (Liu et al. 2024, "KIVI", §3.3-3.4 and Algorithm 1). That is a handful of rows (one per
KV head), so the generic :meth:`kvcodec.UniformQuantizer.quantize` spends nearly all its time on per-call work
(argument checks, group padding, ``QuantizedTensor`` validation) rather than arithmetic. :func:`quantize_tokens`
computes the same codes, scales and zeros -- bit for bit, the rule of :mod:`kvcodec.stats` -- with the fewest
tensor ops on the CPU, and in one launch of kvcodec's fused quantize + pack kernel on CUDA; the caller validates its
input once (finite rows of a float dtype).
"""

from __future__ import annotations

import functools
import sys

import torch

from kvcodec.kernels.dispatch import quantize_pack, use_triton
from kvcodec.packing import pack_unchecked
from kvcodec.stats import next_up, scale_dtype_for, scale_floor


@functools.cache
def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """int32 ``[32 // bits]`` lane offsets of a little-endian 32-bit word."""
    return torch.arange(32 // bits, dtype=torch.int32, device=device) * bits


def _scale(span: torch.Tensor, bits: int, sdt: torch.dtype) -> torch.Tensor:
    """:func:`kvcodec.stats.minmax_scale` (the same values). On the CPU its one-ulp raises are skipped when no scale
    needs one (a host read instead of two rounds of elementwise ops: cheaper for the few groups of a FIFO flush);
    elsewhere both rounds always run (a host read would be a host sync)."""
    levels = float((1 << bits) - 1)
    s = (span / levels).to(sdt).float().clamp_min_(scale_floor(sdt, bits))
    for _ in range(2):
        up = span / s >= levels + 0.5
        if span.device.type == "cpu" and not bool(up.any()):
            break
        s = torch.where(up, next_up(s, sdt), s)
    return s


def fast_tokens(D: int, bits: int, group_size: int) -> bool:
    """Whether :func:`quantize_tokens` takes its fast path for rows of ``D`` channels (whole groups, whole 32-bit
    words of codes per group at 1/2/4 bits); otherwise it falls back to kvcodec's general reference steps."""
    return D % group_size == 0 and bits in (1, 2, 4) and (group_size * bits) % 32 == 0 and sys.byteorder == "little"


def quantize_tokens(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize the rows of ``x [M, D]`` per token in groups of ``group_size`` channels.

    Equal bit for bit to ``kvcodec.UniformQuantizer(bits, "token", group_size).quantize(x[:, None])`` (its codes,
    scales and zeros, reshaped), without its argument checks: ``x`` must be a finite float32/float16/bfloat16 CPU or
    CUDA tensor (the caller checks it once per store mutation).

    Parameters
    ----------
    x : Tensor
        ``[M, D]`` rows (one token of one KV head each).
    bits : int
        Code width in :data:`kvcodec.stats.QUANT_BITS`.
    group_size : int
        ``G``: consecutive channels per group (a partial last group is allowed).

    Returns
    -------
    codes : Tensor
        uint8 ``[M, packed_width(D, bits)]`` (kvcodec's little-endian packing).
    scales, zeros : Tensor
        ``[M, 1, ceil(D / G)]``; scales in ``kvcodec.stats.scale_dtype_for(x.dtype, bits)``, zeros (the group
        minima) in ``x.dtype``.
    """
    M, D = x.shape
    G = group_size
    C = -(-D // G)
    sdt = scale_dtype_for(x.dtype, bits)
    if M == 0:
        pw = (D * bits + 7) // 8
        return (
            torch.zeros(0, pw, dtype=torch.uint8, device=x.device),
            torch.zeros(0, 1, C, dtype=sdt, device=x.device),
            torch.zeros(0, 1, C, dtype=x.dtype, device=x.device),
        )
    if use_triton(x):  # one launch of kvcodec's fused quantize + pack (bit-identical) instead of ~15 small ops
        codes, scales, zeros = quantize_pack(x[:, None, :], bits, "token", G)
        return codes.view(M, -1), scales.view(M, 1, C), zeros.view(M, 1, C)
    xf = x.float()
    if D % G:  # replicate the last channel into the partial group (kvcodec's padding: same min and max)
        xf = torch.cat([xf, xf[:, -1:].expand(M, C * G - D)], 1)
    xg = xf.view(M, C, G)
    lo, hi = torch.aminmax(xg, dim=-1, keepdim=True)
    scale = _scale(hi - lo, bits, sdt)
    q = xg.sub(lo).div_(scale).round_().clamp_(0, (1 << bits) - 1)
    if fast_tokens(D, bits, G):  # whole 32-bit words: one shift and one sum over the lanes
        per = 32 // bits
        words = (q.to(torch.int32).view(M, -1, per) << _shifts(bits, x.device)).sum(-1, dtype=torch.int32)
        codes = words.view(torch.uint8).view(M, -1)
    else:
        codes = pack_unchecked(q.to(torch.uint8).view(M, C * G)[:, :D], bits)
    return codes, scale.view(M, 1, C).to(sdt), lo.view(M, 1, C).to(x.dtype)
