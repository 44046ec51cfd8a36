"""Framing of stored page blobs: magic, format version, codec hash, payload length, checksum.

Layout (little-endian)::

    magic         4 bytes  b"KVPG"
    version       u16      FRAME_VERSION
    reserved      u16      0
    codec hash    16 bytes the codec's config hash (:meth:`kvpages.PageCodec.config_hash`, 32 hex digits)
    payload len   u64
    payload       payload len bytes
    checksum      16 bytes blake2b (digest_size=16) of everything above

:func:`unframe` verifies every field and raises :class:`~kvpages.CorruptEntry` naming what is wrong, so a
truncated file, a flipped bit or a page written by a different codec is a miss, never silently wrong KV.
"""

from __future__ import annotations

import hashlib
import struct

from kvpages.errors import CorruptEntry

MAGIC = b"KVPG"
FRAME_VERSION = 1
HASH_BYTES = 16
_HEADER = struct.Struct(f"<4sHH{HASH_BYTES}sQ")
_SUM_BYTES = 16
OVERHEAD = _HEADER.size + _SUM_BYTES
"""Bytes a frame adds to its payload (48)."""


def _hash_bytes(codec_hash: object) -> bytes:
    if not isinstance(codec_hash, str):
        raise TypeError(f"codec_hash must be a str of {2 * HASH_BYTES} hex digits, got {type(codec_hash).__name__}")
    try:
        raw = bytes.fromhex(codec_hash)
    except ValueError:
        raw = b""
    if len(raw) != HASH_BYTES:
        raise ValueError(f"codec_hash must be {2 * HASH_BYTES} hex digits, got {codec_hash!r}")
    return raw


def _checksum(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_SUM_BYTES).digest()


def frame(payload: bytes | bytearray | memoryview, codec_hash: str) -> bytes:
    """Wrap ``payload`` with the header and checksum above; inverse :func:`unframe`."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
    body = _HEADER.pack(MAGIC, FRAME_VERSION, 0, _hash_bytes(codec_hash), len(payload)) + bytes(payload)
    return body + _checksum(body)


def frame_codec_hash(blob: bytes | bytearray | memoryview) -> str:
    """The codec hash recorded in ``blob``'s header (not verified; :func:`unframe` verifies)."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"blob must be bytes, got {type(blob).__name__}")
    if len(blob) < _HEADER.size:
        raise CorruptEntry(f"blob is too short ({len(blob)} bytes) to be a kvpages frame")
    return _HEADER.unpack_from(blob)[3].hex()


def frame_length(blob: bytes | bytearray | memoryview) -> int:
    """Total bytes (header, payload, checksum) of the frame at the start of ``blob``, read from its header (not
    verified; :func:`unframe` verifies): a reader of a fixed-size slot that holds a frame then zero padding."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"blob must be bytes, got {type(blob).__name__}")
    if len(blob) < _HEADER.size:
        raise CorruptEntry(f"blob is too short ({len(blob)} bytes) to be a kvpages frame")
    magic, _version, _reserved, _hash, n = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise CorruptEntry(f"blob is not a kvpages frame (magic {magic!r}, expected {MAGIC!r})")
    return OVERHEAD + n


def unframe(blob: bytes | bytearray | memoryview, codec_hash: str | None = None) -> memoryview:
    """Verify ``blob`` and return its payload (a zero-copy view of ``blob``).

    Parameters
    ----------
    blob : bytes
        A frame written by :func:`frame`.
    codec_hash : str, optional
        When given, the frame must have been written with this codec hash.

    Raises
    ------
    CorruptEntry
        Wrong magic, unknown version, truncated or padded payload, checksum mismatch, or another codec's hash.
    """
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"blob must be bytes, got {type(blob).__name__}")
    expected = None if codec_hash is None else _hash_bytes(codec_hash)
    view = memoryview(blob).cast("B")
    if len(view) < OVERHEAD:
        raise CorruptEntry(f"blob is too short ({len(view)} bytes) to be a kvpages frame (>= {OVERHEAD})")
    magic, version, _reserved, hash_raw, n = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise CorruptEntry(f"blob is not a kvpages frame (magic {magic!r}, expected {MAGIC!r})")
    if version != FRAME_VERSION:
        raise CorruptEntry(f"unsupported frame version {version}; this kvpages reads version {FRAME_VERSION}")
    if len(view) != OVERHEAD + n:
        raise CorruptEntry(f"frame length {len(view)} does not match its payload length {n} (truncated or padded)")
    body = view[: len(view) - _SUM_BYTES]
    if _checksum(body) != bytes(view[len(view) - _SUM_BYTES :]):
        raise CorruptEntry("checksum mismatch: the stored page is corrupted")
    if expected is not None and hash_raw != expected:
        raise CorruptEntry(f"page was written by codec {hash_raw.hex()}, expected codec {codec_hash}")
    return view[_HEADER.size : len(view) - _SUM_BYTES]
