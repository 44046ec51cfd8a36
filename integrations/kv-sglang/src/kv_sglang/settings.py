"""The backend's settings, read from ``--hicache-storage-backend-extra-config`` and validated at creation."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kvpages
from kvcore.checks import check_int

# keys SGLang itself reads from the same JSON object (the dynamic loader, the controller)
ENGINE_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "interface_v2"})
DEFAULT_CPU_BYTES = 4 << 30


@dataclass(frozen=True)
class StorageSettings:
    """Settings of :class:`~kv_sglang.KVCompressStorage`.

    Parameters
    ----------
    codec : str
        A ``kvpages`` codec name: ``"lossless"`` (default, bit-exact), ``"kivi-4"``, ``"kivi-2"``, ``"int8"`` or one
        installed through the ``kvcompress.codecs`` entry points. Lossy codecs are opt-in; their pages are keyed
        by the codec's config hash, so switching codecs never serves pages written by another.
    codec_options : dict
        Keyword options of the codec factory (e.g. ``{"value_group_size": 64}``).
    cpu_bytes : int
        Byte budget of the in-memory tier (default 4 GiB).
    disk_dir : str, optional
        An existing directory for the disk tier (pages evicted from memory spill there; it survives restarts).
    disk_bytes : int, optional
        Byte budget of the disk tier (unbounded when omitted).
    """

    codec: str = "lossless"
    codec_options: dict[str, Any] = field(default_factory=dict)
    cpu_bytes: int = DEFAULT_CPU_BYTES
    disk_dir: str | None = None
    disk_bytes: int | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> StorageSettings:
        """Parse SGLang's extra config; unknown keys are an error (a misspelled budget must not pass silently)."""
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise TypeError(f"hicache storage extra config must be a JSON object, got {type(extra).__name__}")
        ours = {"codec", "codec_options", "cpu_bytes", "disk_dir", "disk_bytes"}
        unknown = sorted(set(extra) - ours - ENGINE_KEYS)
        if unknown:
            raise ValueError(f"unknown kv_sglang config keys {unknown}; allowed: {sorted(ours)} (plus SGLang's own)")
        return cls(**{k: extra[k] for k in ours if k in extra})

    def __post_init__(self) -> None:
        if not isinstance(self.codec, str):
            raise TypeError(f"codec must be a str, got {type(self.codec).__name__}")
        if not isinstance(self.codec_options, Mapping):
            raise TypeError(f"codec_options must be a JSON object, got {type(self.codec_options).__name__}")
        for name, optional in (("cpu_bytes", False), ("disk_bytes", True)):
            check_int(name, getattr(self, name), low=0, optional="no disk tier" if optional else None)
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, str) or not self.disk_dir:
                raise TypeError(f"disk_dir must be a path string, got {self.disk_dir!r}")
            if not Path(self.disk_dir).is_dir():
                raise ValueError(f"disk_dir {self.disk_dir!r} does not exist or is not a directory (create it first)")
        elif self.disk_bytes is not None:
            raise ValueError("disk_bytes needs disk_dir")
        kvpages.codec(self.codec, **self.codec_options)  # unknown codec or bad options: ValueError now

    def build_cache(self) -> kvpages.PageCache:
        """The codec and the tiered store these settings describe."""
        store = kvpages.TieredStore(self.cpu_bytes, self.disk_dir, self.disk_bytes)
        return kvpages.PageCache(kvpages.codec(self.codec, **self.codec_options), store)
