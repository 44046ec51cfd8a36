"""The stored entry of one block: every attention layer's encoded page, framed and checksummed as a whole.

One block is one entry (not one entry per layer), so an entry is either wholly present or a miss: the scheduler
never promises a block whose layers were half evicted. Payload (little-endian)::

    count                u32
    count x (name_len u16, name utf-8, blob_len u64)
    the blobs, in the same order (each a ``PageCodec.encode`` frame with its own checksum)

wrapped by :func:`kvpages.frame` with the codec's hash, so a truncated or flipped entry, or one written by another
codec configuration, raises :class:`kvpages.CorruptEntry` in :func:`unpack`.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from kvpages import CorruptEntry, frame, unframe

_COUNT = struct.Struct("<I")
_NAME = struct.Struct("<H")
_LEN = struct.Struct("<Q")


def pack(layers: Mapping[str, bytes], codec_hash: str) -> bytes:
    """Frame the per-layer blobs of one block (``layer name -> PageCodec.encode(...)``) as one entry."""
    if not isinstance(layers, Mapping) or not layers:
        raise ValueError("layers must be a non-empty mapping of layer name -> encoded page")
    head = [_COUNT.pack(len(layers))]
    for name, blob in layers.items():
        if not isinstance(name, str):
            raise TypeError(f"layer names must be str, got {type(name).__name__}")
        if not isinstance(blob, (bytes, bytearray)):
            raise TypeError(f"layer {name!r}: encoded page must be bytes, got {type(blob).__name__}")
        raw = name.encode()
        head += [_NAME.pack(len(raw)), raw, _LEN.pack(len(blob))]
    return frame(b"".join(head) + b"".join(bytes(b) for b in layers.values()), codec_hash)


def unpack(entry: bytes, codec_hash: str) -> dict[str, memoryview]:
    """Inverse of :func:`pack`: ``layer name -> encoded page`` (zero-copy views of ``entry``).

    Raises
    ------
    CorruptEntry
        The frame fails its checks (truncated, corrupted, other codec) or its table of contents is inconsistent.
    """
    payload = unframe(entry, codec_hash)
    try:
        (count,) = _COUNT.unpack_from(payload, 0)
        offset = _COUNT.size
        table = []
        for _ in range(count):
            (n,) = _NAME.unpack_from(payload, offset)
            offset += _NAME.size
            name = bytes(payload[offset : offset + n]).decode()
            offset += n
            (length,) = _LEN.unpack_from(payload, offset)
            offset += _LEN.size
            table.append((name, length))
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptEntry(f"block entry has a damaged table of contents: {exc}") from None
    out: dict[str, memoryview] = {}
    for name, length in table:
        if offset + length > len(payload):
            raise CorruptEntry(f"block entry is truncated in layer {name!r}")
        out[name] = payload[offset : offset + length]
        offset += length
    if offset != len(payload):
        raise CorruptEntry(f"block entry has {len(payload) - offset} trailing bytes")
    return out
