"""The connector's settings, read from ``kv_connector_extra_config`` and validated up front."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import kvpages
from kvcore.checks import check_int

from .layout import LAYOUTS

GiB = 1 << 30


def _method_names() -> set[str]:
    """Names of registered kvcompress methods (SnapKV, H2O, ...): Compressors, most of which drop tokens."""
    from kvcore import registry

    return set(registry.discover())


def _refuse_method(what: str, available: list[str], name: str | None = None) -> ValueError:
    family = name.split("-")[0] if name else None
    related = [c for c in available if family and c.split("-")[0] == family]
    hint = f" This method's package registers the page codecs {related}." if related else ""
    return ValueError(
        f"{what} is a kvcompress compression method (a Compressor of Scorer, Selector and Store), not a page "
        f"codec. A vLLM KV connector must supply every prefix token it reports (vLLM allocates and attends to all "
        f"of them) and moves pages through a page codec, so a method's Compressor cannot run through it, whether "
        f"it evicts tokens or keeps them at lower precision.{hint} Use a page codec, which keeps every token at "
        f"some precision: {available} ('lossless' is bit-exact)"
    )


def check_codec_name(name: object) -> str:
    """Return ``name`` if it names a :mod:`kvpages` codec, else raise saying what to use.

    A kvcompress compression *method* (a registry name such as ``"snapkv"``, or a ``kvcore.Compressor``) that is not
    also a codec name is refused with its own ``ValueError``: a KV connector must supply every prefix token and moves
    pages through a codec, so a Compressor cannot run through it (eviction cannot be expressed at all); page codecs
    (every token kept, possibly at lower precision) can, including those a method package registers under
    ``kvcompress.codecs`` (HEX's ``hex-3``, HqeKV's ``hqekv-2`` ...; the message lists a method's own codecs).
    """
    from kvcore import Compressor

    available = kvpages.codec_names()
    if isinstance(name, Compressor):
        raise _refuse_method(f"codec {name!r}", available)
    if not isinstance(name, str):
        raise TypeError(f"codec must be a str naming a kvpages codec, got {type(name).__name__}")
    if name in available:
        return name
    if name in _method_names():
        raise _refuse_method(f"codec {name!r}", available, name)
    raise ValueError(f"unknown codec {name!r}; available codecs: {available}")


@dataclass(frozen=True)
class ConnectorConfig:
    """Settings of :class:`kv_vllm.KVCompressConnector` (the ``kv_connector_extra_config`` mapping).

    Parameters
    ----------
    codec : str
        A :mod:`kvpages` codec: ``"lossless"`` (bit-exact, the default), ``"kivi-4"``, ``"kivi-2"``
        (KIVI's grouping: keys per channel over the block's tokens, values per token in groups of 32 channels;
        Liu et al. 2024, §3), ``"int8"``, or one a package registers under ``kvcompress.codecs`` (kv-hex:
        ``"hex-3"``, ``"hex-4"``, ``"kcvt-3"``, ``"kcvt-4"``; kv-hqekv: ``"hqekv-2"`` ... ``"hqekv-3.25"``).
    codec_options : dict
        Keyword options passed to the codec's factory.
    cpu_bytes : int
        Byte budget of the CPU tier (LRU). Default 2 GiB.
    disk_dir : str, optional
        Existing directory for the second tier (entries evicted from the CPU tier spill there; they survive a
        restart of the engine). Several processes may share it: it is one cache with one budget (see
        :class:`kvpages.TieredStore`). Without it, evicted entries are dropped.
    disk_bytes : int, optional
        Byte budget of the disk tier, for the directory as a whole (unbounded when None). Only with ``disk_dir``.
    layout : str
        Paged layout of the attention backend's per-layer view: ``"auto"`` (from the backend's name),
        ``"split_last"`` or ``"cpu"`` (see :mod:`kv_vllm.layout`).
    tag : str
        Extra namespace for the cache keys (keeps deployments sharing a disk directory apart).
    """

    codec: str = "lossless"
    codec_options: dict[str, Any] = field(default_factory=dict)
    cpu_bytes: int = 2 * GiB
    disk_dir: str | None = None
    disk_bytes: int | None = None
    layout: str = "auto"
    tag: str = ""

    def __post_init__(self) -> None:
        check_codec_name(self.codec)
        if not isinstance(self.codec_options, Mapping):
            raise TypeError(f"codec_options must be a mapping, got {type(self.codec_options).__name__}")
        check_int("cpu_bytes", self.cpu_bytes, low=0)
        if self.disk_bytes is not None:
            check_int("disk_bytes", self.disk_bytes, low=0)
            if self.disk_dir is None:
                raise ValueError("disk_bytes needs disk_dir (there is no disk tier without a directory)")
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)):
                raise TypeError(f"disk_dir must be a path string, got {type(self.disk_dir).__name__}")
            if not Path(self.disk_dir).is_dir():
                raise ValueError(f"disk_dir {str(self.disk_dir)!r} does not exist or is not a directory")
        if self.layout != "auto" and self.layout not in LAYOUTS:
            raise ValueError(f"layout must be 'auto' or one of {list(LAYOUTS)}, got {self.layout!r}")
        if not isinstance(self.tag, str):
            raise TypeError(f"tag must be a str, got {type(self.tag).__name__}")
        if self.cpu_bytes == 0 and self.disk_dir is None:
            raise ValueError("cpu_bytes is 0 and there is no disk_dir: the connector could store nothing")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config``; unknown keys are a ``ValueError`` listing the known."""
        extra = dict(extra or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known keys: {known}")
        return cls(**extra)

    def build_codec(self) -> kvpages.PageCodec:
        """The configured :class:`kvpages.PageCodec`."""
        return kvpages.codec(self.codec, **dict(self.codec_options))

    def build_store(self) -> kvpages.TieredStore:
        """A fresh :class:`kvpages.TieredStore` with the configured budgets and disk tier."""
        return kvpages.TieredStore(self.cpu_bytes, disk_dir=self.disk_dir, disk_bytes=self.disk_bytes)
