"""Dense bit-packing of integer codes along the last dimension (the ``kvcore.QuantizedTensor`` layout).

Code ``j`` of a row occupies bits ``j*b .. j*b+b-1`` of the row's little-endian bit stream, so a row of
``d`` codes takes ``kvcore.packed_width(d, b) = ceil(d*b/8)`` bytes: 8/b codes per byte for b in {1, 2, 4, 8}
and 8 codes in 3 bytes for b = 3. KIVI (``quant/new_pack.py``) packs 32/b codes per int32 instead, which
only works for b dividing 32 and rows that are a multiple of 32/b codes; this layout has neither limit.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvcore import QuantizedTensor, packed_width
from kvcore.checks import check_int

PACK_BITS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
"""Code widths :func:`pack_codes` accepts."""


def _check_bits(bits: object) -> int:
    return check_int("bits", bits, choices=PACK_BITS)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``bits``-wide codes densely along the last dimension.

    Parameters
    ----------
    codes : Tensor
        uint8 ``[..., D]``, every value ``< 2**bits``.
    bits : int
        Code width, 1 to 8.

    Returns
    -------
    Tensor
        uint8 ``[..., packed_width(D, bits)]``; bits past ``D*bits`` in the last byte are zero.
    """
    bits = _check_bits(bits)
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if codes.ndim < 1:
        raise ValueError("codes must have rank >= 1 ([..., D])")
    if codes.numel() and int(codes.max()) >= (1 << bits):
        raise ValueError(f"codes must be < 2**bits = {1 << bits}, got a code {int(codes.max())}")
    return pack_unchecked(codes, bits)


def pack_unchecked(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_codes` without argument checks (for callers that produced valid codes)."""
    *lead, d = codes.shape
    width = packed_width(d, bits)
    if bits == 8:
        return codes.clone(memory_format=torch.contiguous_format)
    if 8 % bits == 0:  # 1, 2, 4 bits: whole codes per byte, combined lane by lane in uint8
        per = 8 // bits
        c = F.pad(codes, (0, width * per - d)).reshape(*lead, width, per)
        out = c[..., 0].clone(memory_format=torch.contiguous_format)
        for lane in range(1, per):
            out |= c[..., lane] << (lane * bits)
        return out
    chunks = -(-d // 8)  # 8 codes fill exactly `bits` bytes (at most 56 bits: int64)
    c = F.pad(codes, (0, chunks * 8 - d)).reshape(*lead, chunks, 8).to(torch.int64)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1)  # disjoint bit fields: sum == or
    byte_shift = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    out = ((word[..., None] >> byte_shift) & 0xFF).to(torch.uint8).view(*lead, chunks * bits)
    return out if out.shape[-1] == width else out[..., :width].clone(memory_format=torch.contiguous_format)


def unpack_codes(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``uint8 [..., packed_width(d, bits)] -> uint8 [..., d]``."""
    bits = _check_bits(bits)
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    check_int("d", d, low=0)
    width = packed_width(d, bits)
    if packed.ndim < 1 or packed.shape[-1] != width:
        raise ValueError(f"packed must have shape [..., {width}] for d={d}, bits={bits}, got {tuple(packed.shape)}")
    return unpack_unchecked(packed, bits, d)


@functools.lru_cache(maxsize=32)
def _shifts(count: int, bits: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """``[0, bits, 2·bits, ...]`` (``count`` of them), cached per device: an unpack on a GPU launches no arange."""
    return torch.arange(count, device=device, dtype=dtype) * bits


def unpack_unchecked(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """:func:`unpack_codes` without argument checks."""
    *lead, width = packed.shape
    if bits == 8:
        return packed.clone(memory_format=torch.contiguous_format)
    if 8 % bits == 0:  # 1, 2, 4 bits
        per = 8 // bits
        shifts = _shifts(per, bits, torch.uint8, str(packed.device))
        codes = ((packed[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*lead, width * per)
    else:
        chunks = -(-d // 8)
        p = F.pad(packed, (0, chunks * bits - width)).reshape(*lead, chunks, bits)
        wide = torch.int32 if bits * 8 < 32 else torch.int64  # a chunk of 8 codes is a bits-byte word
        word = p[..., 0].to(wide)
        for i in range(1, bits):  # OR the bytes in (a reduction over a 3-7 wide axis is ~2x slower on CPU)
            word |= p[..., i].to(wide) << (8 * i)
        shifts = _shifts(8, bits, wide, str(packed.device))
        codes = ((word[..., None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8).view(*lead, chunks * 8)
    return codes if codes.shape[-1] == d else codes[..., :d].clone(memory_format=torch.contiguous_format)


def pack_quantized(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    *,
    bits: int,
    axis: str,
    group_size: int,
    like: torch.Tensor,
    codebook: torch.Tensor | None = None,
) -> QuantizedTensor:
    """A :class:`kvcore.QuantizedTensor` of unpacked ``codes`` (one uint8 per element, ``< 2**bits``) quantizing
    ``like``: the codes bit-packed (:func:`pack_unchecked`), the shape and dtype taken from ``like``. The one place a
    quantizer assembles its result (uniform, codebook and HqeKV's normalized tiers)."""
    return QuantizedTensor(
        codes=pack_unchecked(codes, bits),
        scales=scales,
        zeros=zeros,
        bits=bits,
        axis=axis,
        group_size=group_size,
        shape=tuple(like.shape),
        dtype=like.dtype,
        codebook=codebook,
    )
