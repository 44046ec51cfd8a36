"""The page codec contract: ``[tokens, kv_heads, head_dim]`` keys and values to a framed blob and back."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from kvcore.checks import check_finite, check_float, check_tensor
from kvpages.faults import NonFinitePage
from kvpages.framing import FRAME_VERSION, frame, unframe

CODEC_FORMAT_VERSION = 1
"""Version of the built-in payload formats; part of every :meth:`PageCodec.config_hash`."""


class PageCodec(ABC):
    """Encodes one page of keys and values ``[tokens, kv_heads, head_dim]`` to bytes and back.

    Subclasses declare ``name`` and ``lossless`` as class attributes, give their settings in :meth:`config`, and
    implement :meth:`encode_payload` / :meth:`decode_payload`. The base class validates inputs and frames the
    payload (:mod:`kvpages.framing`) with :meth:`config_hash`, so :meth:`decode` rejects a corrupted blob or a blob
    written by another codec (or the same codec with other settings) with :class:`~kvpages.CorruptEntry`.

    A lossless codec gives back the input bit for bit; a lossy codec documents its error bound.
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]
    format_version: ClassVar[int] = CODEC_FORMAT_VERSION

    @abstractmethod
    def config(self) -> dict[str, Any]:
        """The codec's settings as a JSON-able dict (everything that changes the stored bytes)."""

    @abstractmethod
    def encode_payload(self, keys: torch.Tensor, values: torch.Tensor) -> bytes:
        """Payload bytes for validated keys and values of equal shape and dtype (any device)."""

    @abstractmethod
    def decode_payload(self, payload: memoryview, device: torch.device | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Inverse of :meth:`encode_payload`; raise :class:`~kvpages.CorruptEntry` on an inconsistent payload."""

    def config_hash(self) -> str:
        """Hex digest (32 digits) of the codec name, payload format version, frame version and :meth:`config`.

        Part of every cache key: entries written with other settings are never read back as this codec's.
        """
        spec = {"name": self.name, "format": self.format_version, "frame": FRAME_VERSION, "config": self.config()}
        return hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=16).hexdigest()

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> bytes:
        """Encode one page: ``keys`` and ``values`` ``[tokens, kv_heads, head_dim]``, same shape and float dtype.

        Raises ``TypeError``/``ValueError`` naming the argument for a non-tensor, a wrong rank, mismatched shapes
        or dtypes, an unsupported dtype or an empty page; :class:`~kvpages.NonFinitePage` (a ``ValueError``) for
        a non-finite entry under a lossy codec.
        """
        for name, x in (("keys", keys), ("values", values)):
            check_float(name, check_tensor(name, x, ndim=3))
            if x.numel() == 0:
                raise ValueError(f"{name} must be a non-empty page, got shape {tuple(x.shape)}")
        if keys.shape != values.shape:
            raise ValueError(
                f"keys and values must have the same shape, got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if keys.dtype != values.dtype:
            raise TypeError(f"keys and values must have the same dtype, got {keys.dtype} and {values.dtype}")
        if keys.device != values.device:
            raise ValueError(f"keys and values must be on the same device, got {keys.device} and {values.device}")
        if not self.lossless:
            for name, x in (("keys", keys), ("values", values)):
                try:
                    check_finite(name, x)
                except ValueError as exc:
                    raise NonFinitePage(f"{exc}: a lossy codec cannot encode it") from None
        return frame(self.encode_payload(keys, values), self.config_hash())

    def decode(self, blob: bytes, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode a blob written by :meth:`encode` to ``(keys, values)`` on ``device`` (CPU when None).

        Raises
        ------
        CorruptEntry
            The blob is truncated, corrupted, or was written by a different codec configuration.
        """
        dev = None if device is None else torch.device(device)
        return self.decode_payload(unframe(blob, self.config_hash()), dev)

    def fp16_bytes(self, tokens: int, kv_heads: int, head_dim: int) -> int:
        """Bytes the same page of keys and values occupies in fp16 (the reference for compression ratios)."""
        return 2 * 2 * tokens * kv_heads * head_dim

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"
