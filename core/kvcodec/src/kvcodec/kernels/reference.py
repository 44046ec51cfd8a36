"""PyTorch references of the hot quantization operations (the CPU path; same signatures as the Triton kernels).

* :func:`quantize_pack_ref` -- fused min-max quantize + dense bit-pack (KIVI ``quant_and_pack_{k,v}cache``).
* :func:`unpack_dequantize_ref` -- unpack + dequantize (KIVI ``unpack_and_dequant_{k,v}cache``).
* :func:`compact_ref` -- gather the kept entries of a ragged per-head selection into one flat buffer.

Arguments are assumed valid (the public entry points, ``UniformQuantizer`` and the dispatchers, check them).
"""

from __future__ import annotations

import math

import torch

from kvcodec.packing import pack_unchecked, unpack_unchecked
from kvcodec.stats import minmax_scale, scale_dtype_for
from kvcore import packed_width


def _pad_groups(x: torch.Tensor, axis: str, group_size: int, replicate: bool) -> tuple[torch.Tensor, int]:
    """``[M, T, D]`` -> grouped view ``[M, T, n, G]`` (token) or ``[M, n, G, D]`` (channel), and ``n``.

    A partial last group is filled by repeating the last element (which leaves its min and max unchanged)
    or with zeros.
    """
    M, T, D = x.shape
    G = group_size
    if axis == "token":
        n = -(-D // G)
        if n * G != D:
            fill = x[..., -1:] if replicate else torch.zeros_like(x[..., :1])
            x = torch.cat([x, fill.expand(M, T, n * G - D)], -1)
        return x.view(M, T, n, G), n
    n = -(-T // G)
    if n * G != T:
        fill = x[:, -1:] if replicate else torch.zeros_like(x[:, :1])
        x = torch.cat([x, fill.expand(M, n * G - T, D)], 1)
    return x.view(M, n, G, D), n


def quantize_pack_ref(
    x: torch.Tensor, bits: int, axis: str, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., T, D]`` per group with the min-max rule of :mod:`kvcodec.stats`.

    Returns
    -------
    codes : Tensor
        uint8 ``[..., T, packed_width(D, bits)]``.
    scales, zeros : Tensor
        ``[..., T, ceil(D/G)]`` (``axis="token"``) or ``[..., ceil(T/G), D]`` (``axis="channel"``); scales in
        ``scale_dtype_for(x.dtype, bits)``, zeros (the group minima) in ``x.dtype``.
    """
    *lead, T, D = x.shape
    G = group_size
    sdt = scale_dtype_for(x.dtype, bits)
    gshape = (*lead, T, -(-D // G)) if axis == "token" else (*lead, -(-T // G), D)
    if x.numel() == 0:
        return (
            torch.zeros(*lead, T, packed_width(D, bits), dtype=torch.uint8, device=x.device),
            torch.zeros(gshape, dtype=sdt, device=x.device),
            torch.zeros(gshape, dtype=x.dtype, device=x.device),
        )
    M = math.prod(lead)
    xg, _ = _pad_groups(x.reshape(M, T, D).float(), axis, G, replicate=True)
    rdim = -1 if axis == "token" else -2
    lo, hi = xg.amin(rdim, keepdim=True), xg.amax(rdim, keepdim=True)
    scale = minmax_scale(hi - lo, bits, sdt)
    codes = torch.round((xg - lo) / scale).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    codes = codes.view(M, T, -1) if axis == "token" else codes.view(M, -1, D)
    packed = pack_unchecked(codes[:, :T, :D], bits)
    return (
        packed.view(*lead, T, packed.shape[-1]),
        scale.squeeze(rdim).to(sdt).reshape(gshape),
        lo.squeeze(rdim).to(x.dtype).reshape(gshape),
    )


def unpack_dequantize_ref(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    bits: int,
    axis: str,
    group_size: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> torch.Tensor:
    """Inverse of :func:`quantize_pack_ref` up to the quantization error: ``zero + code * scale`` in ``dtype``.

    Computed in float32 (a product, then a sum) and clamped to the finite range of ``dtype`` before the
    final round-to-nearest cast.
    """
    *lead, T, D = shape
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype, device=codes.device)
    M = math.prod(lead)
    c = unpack_unchecked(codes.reshape(M, T, codes.shape[-1]), bits, D)
    cg, n = _pad_groups(c, axis, group_size, replicate=False)
    if axis == "token":
        s, z = scales.reshape(M, T, n, 1).float(), zeros.reshape(M, T, n, 1).float()
    else:
        s, z = scales.reshape(M, n, 1, D).float(), zeros.reshape(M, n, 1, D).float()
    fmax = torch.finfo(dtype).max
    y = (z + cg.float() * s).clamp_(-fmax, fmax).to(dtype)
    y = y.view(M, T, -1)[:, :, :D] if axis == "token" else y.view(M, -1, D)[:, :T]
    return y.reshape(shape)


def compact_ref(x: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept entries of ``x [B, H, T, D]`` under ``keep [B, H, T]`` as ``([N, D] in (b, h, t) order, [B, H] counts)``."""
    return x[keep], keep.sum(-1)


def dequantize_rows_ref(side, row: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """float32 ``[*row.shape, D]``: dequantized code rows (``row >= 0``) or full rows (``row < 0``) of a
    :class:`~kvcodec.attention.CodeRows`.

    Code rows are dequantized exactly as :func:`unpack_dequantize_ref` does for the cache dtype ``side.full.dtype``
    (``zero + code * scale`` in float32, clamped to the dtype's finite range and rounded to it), so attention over
    them equals attention over the dequantized cache a store reads back."""
    D = side.head_dim
    r, g = row.reshape(-1).long(), group.reshape(-1).long()
    quant = r >= 0
    out = torch.zeros(r.numel(), D, dtype=torch.float32, device=row.device)
    if side.codes.shape[0] and bool(quant.any()):
        qr, qg = r[quant], g[quant]
        codes = unpack_unchecked(side.codes[qr], side.bits, D).float()
        col = torch.arange(D, device=row.device)
        if side.axis == "token":
            col = col // side.group_size
        fmax = torch.finfo(side.full.dtype).max
        y = side.zeros.float()[qg][:, col] + codes * side.scales.float()[qg][:, col]
        out[quant] = y.clamp_(-fmax, fmax).to(side.full.dtype).float()
    if side.full.shape[0] and bool((~quant).any()):
        out[~quant] = side.full.float()[-1 - r[~quant]]
    return out.view(*row.shape, D)


def quantized_attention_ref(query: torch.Tensor, segment, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch reference of :func:`~kvcodec.quantized_attention` (dequantizes, then ``kvcore.reference_attention``)."""
    from kvcore import KVView, reference_attention

    k = dequantize_rows_ref(segment.keys, segment.key_row, segment.key_group)
    v = dequantize_rows_ref(segment.values, segment.value_row, segment.value_group)
    bias = segment.bias.float()
    pos = torch.where(bias == float("-inf"), -1, 0).long()
    return reference_attention(KVView(k, v, pos, bias), query, scale)
