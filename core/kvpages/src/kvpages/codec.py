"""The page codec contract: ``[tokens, kv_heads, head_dim]`` keys and values to a framed blob and back."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from kvcore.checks import check_finite, check_float, check_tensor
from kvpages.faults import NonFinitePage
from kvpages.framing import FRAME_VERSION, OVERHEAD, frame, unframe

CODEC_FORMAT_VERSION = 1
"""Version of the built-in payload formats; part of every :meth:`PageCodec.config_hash`."""


class PageCodec(ABC):
    """Encodes one page of keys and values ``[tokens, kv_heads, head_dim]`` to bytes and back.

    Subclasses declare ``name`` and ``lossless`` as class attributes, give their settings in :meth:`config`, and
    implement :meth:`encode_payload` / :meth:`decode_payload`. The base class validates inputs and frames the
    payload (:mod:`kvpages.framing`) with :meth:`config_hash`, so :meth:`decode` rejects a corrupted blob or a blob
    written by another codec (or the same codec with other settings) with :class:`~kvpages.CorruptEntry`.

    A lossless codec gives back the input bit for bit; a lossy codec documents its error bound.

    Two optional capabilities are *declared* by class attributes (a caller reads the flag, never probes):

    * ``bounded_size``: :meth:`max_encoded_bytes` gives the largest blob :meth:`encode` can return for a page
      shape (implemented through :meth:`max_payload_bytes`), so an engine can size a fixed-bytes page for it.
    * ``accepts_importance``: :meth:`encode` takes a per-token ``importance`` ``[T, H]`` (e.g. the attention an
      engine measured) in place of the codec's own query-free ranking; the codec's :meth:`encode_payload` then
      takes it as the keyword ``importance``. The tiers are stored in the payload, so decoding never needs it.
    """

    name: ClassVar[str]
    lossless: ClassVar[bool]
    format_version: ClassVar[int] = CODEC_FORMAT_VERSION
    bounded_size: ClassVar[bool] = False
    """True when :meth:`max_payload_bytes` is implemented (so :meth:`max_encoded_bytes` answers)."""
    accepts_importance: ClassVar[bool] = False
    """True when :meth:`encode` may be given an ``importance`` (passed to :meth:`encode_payload`)."""

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

    def encode(self, keys: torch.Tensor, values: torch.Tensor, importance: torch.Tensor | None = None) -> bytes:
        """Encode one page: ``keys`` and ``values`` ``[tokens, kv_heads, head_dim]``, same shape and float dtype.

        ``importance`` (only for a codec declaring ``accepts_importance``): a finite, non-negative float tensor
        ``[tokens, kv_heads]`` ranking the page's tokens per KV head (larger: more important), used in place of
        the codec's own query-free importance.

        Raises ``TypeError``/``ValueError`` naming the argument for a non-tensor, a wrong rank, mismatched shapes
        or dtypes, an unsupported dtype or an empty page, an ``importance`` given to a codec that does not accept
        one or of the wrong shape; :class:`~kvpages.NonFinitePage` (a ``ValueError``) for a non-finite entry
        under a lossy codec.
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
        if importance is None:
            return frame(self.encode_payload(keys, values), self.config_hash())
        if not self.accepts_importance:
            raise TypeError(f"codec {self.name!r} does not accept an importance (accepts_importance is False)")
        check_float("importance", check_tensor("importance", importance, ndim=2))
        if tuple(importance.shape) != tuple(keys.shape[:2]):
            raise ValueError(
                f"importance must be [tokens, kv_heads] = {tuple(keys.shape[:2])}, got {tuple(importance.shape)}"
            )
        check_finite("importance", importance)
        if bool((importance < 0).any()):
            raise ValueError("importance must be non-negative")
        return frame(self.encode_payload(keys, values, importance=importance), self.config_hash())

    def max_payload_bytes(self, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Largest payload :meth:`encode_payload` writes for a page of that shape (codecs with ``bounded_size``)."""
        raise NotImplementedError(f"codec {self.name!r} does not declare a bounded encoded size")

    def max_encoded_bytes(self, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Largest blob :meth:`encode` returns for a ``[tokens, kv_heads, head_dim]`` page in ``dtype``, framing
        included: what an engine reserves for a fixed-size page. Exact for codecs whose size is fixed.

        Raises
        ------
        NotImplementedError
            The codec does not declare ``bounded_size``.
        ValueError
            A non-positive dimension or an unsupported dtype.
        """
        if not self.bounded_size:
            raise NotImplementedError(f"codec {self.name!r} does not declare a bounded encoded size")
        for arg, n in (("tokens", tokens), ("kv_heads", kv_heads), ("head_dim", head_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{arg} must be an int >= 1, got {n!r}")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
        return OVERHEAD + self.max_payload_bytes(tokens, kv_heads, head_dim, dtype)

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
