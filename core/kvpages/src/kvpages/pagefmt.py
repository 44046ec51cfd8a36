"""The small binary header shared by the built-in payloads: page shape and dtype, then raw tensor bytes."""

from __future__ import annotations

import struct

import torch

from kvpages.errors import CorruptEntry

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
DTYPES = {v: k for k, v in DTYPE_CODES.items()}
SHAPE = struct.Struct("<BIII")  # dtype code, tokens, kv_heads, head_dim


def pack_shape(x: torch.Tensor) -> bytes:
    """Header of a page ``x [T, H, D]``."""
    T, H, D = x.shape
    return SHAPE.pack(DTYPE_CODES[x.dtype], T, H, D)


def unpack_shape(payload: memoryview) -> tuple[torch.dtype, int, int, int]:
    """Inverse of :func:`pack_shape`; raises :class:`CorruptEntry` on an unknown dtype or a short payload."""
    if len(payload) < SHAPE.size:
        raise CorruptEntry(f"payload too short ({len(payload)} bytes) for its page header")
    code, T, H, D = SHAPE.unpack_from(payload)
    if code not in DTYPES:
        raise CorruptEntry(f"unknown dtype code {code} in page header")
    return DTYPES[code], T, H, D


def raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` in C order (any device, any layout, any dtype including bf16)."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from(
    payload: memoryview, offset: int, dtype: torch.dtype, shape: tuple[int, ...], name: str
) -> tuple[torch.Tensor, int]:
    """Read a ``dtype`` tensor of ``shape`` at ``offset``; returns it (a fresh CPU tensor) and the next offset."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if offset + nbytes > len(payload):
        raise CorruptEntry(f"payload truncated in {name} ({len(payload) - offset} of {nbytes} bytes)")
    buf = bytearray(payload[offset : offset + nbytes])
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype), offset
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape), offset + nbytes


def check_end(payload: memoryview, offset: int) -> None:
    """Reject trailing bytes after the last tensor."""
    if offset != len(payload):
        raise CorruptEntry(f"{len(payload) - offset} unexpected trailing bytes in page payload")
