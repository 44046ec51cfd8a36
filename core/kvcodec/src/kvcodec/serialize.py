"""Serialization of a ``kvcore.QuantizedTensor`` to ``bytes`` and back (versioned, checksummed, bit-exact).

Layout (little-endian)::

    magic     4 bytes  b"KVQT"
    version   u16      FORMAT_VERSION
    hlen      u32      length of the header
    header    hlen     UTF-8 JSON: dtype, shape, bits, axis, group_size, and per tensor (codes, scales, zeros,
                       codebook) its dtype, shape and byte length (absent tensors: null)
    payload            the tensors' raw bytes, in header order
    crc32     u32      zlib.crc32 of everything above

:func:`from_bytes` verifies magic, version, lengths and checksum and raises ``ValueError`` naming what is wrong.
Tensors come back on the CPU, contiguous; every field is bit-identical to the serialized tensor's.
"""

from __future__ import annotations

import json
import struct
import zlib

import torch

from kvcore import QuantizedTensor

MAGIC = b"KVQT"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI")
_CRC = struct.Struct("<I")
_FIELDS = ("codes", "scales", "zeros", "codebook")
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.bool,
    )
}


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"cannot serialize dtype {dtype}; supported: {sorted(_DTYPES)}")
    return name


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def to_bytes(q: QuantizedTensor) -> bytes:
    """Serialize ``q`` (any device) to a self-describing byte string; inverse :func:`from_bytes`."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a kvcore.QuantizedTensor, got {type(q).__name__}")
    tensors, payload = {}, []
    for name in _FIELDS:
        t = getattr(q, name)
        if t is None:
            tensors[name] = None
            continue
        raw = _raw(t)
        tensors[name] = {"dtype": _dtype_name(t.dtype), "shape": list(t.shape), "nbytes": len(raw)}
        payload.append(raw)
    header = json.dumps(
        {
            "dtype": _dtype_name(q.dtype),
            "shape": list(q.shape),
            "bits": q.bits,
            "axis": q.axis,
            "group_size": q.group_size,
            "tensors": tensors,
        },
        sort_keys=True,
    ).encode()
    body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + b"".join(payload)
    return body + _CRC.pack(zlib.crc32(body))


def from_bytes(data: bytes | bytearray | memoryview) -> QuantizedTensor:
    """Load a ``QuantizedTensor`` written by :func:`to_bytes` (CPU tensors).

    Raises
    ------
    ValueError
        Not a kvcodec payload (magic), an unknown format version, a truncated payload, or a checksum mismatch.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _PREFIX.size + _CRC.size:
        raise ValueError(f"data is too short ({len(data)} bytes) to be a serialized QuantizedTensor")
    magic, version, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"data is not a serialized QuantizedTensor (magic {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise ValueError(f"unsupported format version {version}; this kvcodec reads version {FORMAT_VERSION}")
    body, (crc,) = data[: -_CRC.size], _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(body) != crc:
        raise ValueError("checksum mismatch: the serialized QuantizedTensor is corrupted")
    start = _PREFIX.size
    if start + hlen > len(body):
        raise ValueError("truncated header in serialized QuantizedTensor")
    try:
        meta = json.loads(body[start : start + hlen])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"unreadable header in serialized QuantizedTensor: {e}") from None
    offset = start + hlen
    fields = {}
    for name in _FIELDS:
        spec = meta["tensors"].get(name)
        if spec is None:
            fields[name] = None
            continue
        dtype, shape, n = _DTYPES[spec["dtype"]], tuple(spec["shape"]), spec["nbytes"]
        if offset + n > len(body):
            raise ValueError(f"truncated payload in serialized QuantizedTensor (tensor {name})")
        raw = bytearray(body[offset : offset + n])
        offset += n
        if n == 0:
            fields[name] = torch.empty(shape, dtype=dtype)
        else:
            fields[name] = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)
    if offset != len(body):
        raise ValueError(f"{len(body) - offset} unexpected trailing bytes in serialized QuantizedTensor")
    return QuantizedTensor(
        codes=fields["codes"],
        scales=fields["scales"],
        zeros=fields["zeros"],
        bits=meta["bits"],
        axis=meta["axis"],
        group_size=meta["group_size"],
        shape=tuple(meta["shape"]),
        dtype=_DTYPES[meta["dtype"]],
        codebook=fields["codebook"],
    )
