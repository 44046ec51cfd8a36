"""A page cache: a codec over a store, with the metrics an engine adapter reports."""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass

import torch

from kvpages.byte_counts import ByteCounts
from kvpages.codec import PageCodec
from kvpages.errors import CorruptEntry
from kvpages.tiered import TieredStore


@dataclass(frozen=True)
class CacheMetrics(ByteCounts):
    """A snapshot of a :class:`PageCache`'s counters.

    ``stored_bytes`` / ``fp16_bytes`` are summed over every :meth:`PageCache.save` (the blob lengths written, and
    the bytes the same pages take in fp16); ``compression`` is their ratio ``fp16_bytes / stored_bytes``.
    ``corrupt`` counts loads that found a blob the codec rejected (dropped and reported as misses).
    """

    saves: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    stored_bytes: int = 0
    fp16_bytes: int = 0
    encode_seconds: float = 0.0
    decode_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), **self.byte_summary()}


class PageCache:
    """Saves and loads pages of keys and values ``[tokens, kv_heads, head_dim]`` through ``codec`` into ``store``.

    Entries are stored under ``"<codec config hash>/<key>"``, so caches with different codecs (or codec settings)
    can share one store without ever reading each other's pages; the codec also verifies the hash in every blob.
    A blob the codec rejects (:class:`~kvpages.CorruptEntry`) is deleted from the store and loads as a miss.
    """

    def __init__(self, codec: PageCodec, store: TieredStore):
        if not isinstance(codec, PageCodec):
            raise TypeError(f"codec must be a kvpages.PageCodec (see kvpages.codec(name)), got {type(codec).__name__}")
        if not isinstance(store, TieredStore):
            raise TypeError(f"store must be a kvpages.TieredStore, got {type(store).__name__}")
        self.codec = codec
        self.store = store
        self._prefix = codec.config_hash() + "/"
        self._lock = threading.Lock()
        self._m = {"saves": 0, "hits": 0, "misses": 0, "corrupt": 0, "stored_bytes": 0, "fp16_bytes": 0}
        self._t = {"encode_seconds": 0.0, "decode_seconds": 0.0}

    def store_key(self, key: str) -> str:
        """The key ``key`` is held under in the store."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str, got {key!r}")
        return self._prefix + key

    def save(self, key: str, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Encode and store one page under ``key``; returns the stored blob's length in bytes, or 0 when the store
        did not keep it (larger than every tier, or a failed disk write: counted in ``store.metrics.faults``)."""
        skey = self.store_key(key)
        t0 = time.perf_counter()
        blob = self.codec.encode(keys, values)
        dt = time.perf_counter() - t0
        if not self.store.put(skey, blob):
            with self._lock:
                self._t["encode_seconds"] += dt
            return 0
        with self._lock:
            self._m["saves"] += 1
            self._m["stored_bytes"] += len(blob)
            self._m["fp16_bytes"] += self.codec.fp16_bytes(*keys.shape)
            self._t["encode_seconds"] += dt
        return len(blob)

    def load(self, key: str, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The page under ``key`` as ``(keys, values)`` on ``device``, or None on a miss (absent or corrupt)."""
        skey = self.store_key(key)
        blob = self.store.get(skey)
        if blob is None:
            with self._lock:
                self._m["misses"] += 1
            return None
        t0 = time.perf_counter()
        try:
            kv = self.codec.decode(blob, device)
        except CorruptEntry:
            self.store.delete(skey)
            with self._lock:
                self._m["corrupt"] += 1
                self._m["misses"] += 1
            return None
        with self._lock:
            self._m["hits"] += 1
            self._t["decode_seconds"] += time.perf_counter() - t0
        return kv

    def exists(self, key: str) -> bool:
        """Whether a page is held under ``key`` (not verified until loaded)."""
        return self.store.contains(self.store_key(key))

    def delete(self, key: str) -> bool:
        """Remove the page under ``key``; returns whether one was held."""
        return self.store.delete(self.store_key(key))

    @property
    def metrics(self) -> CacheMetrics:
        with self._lock:
            return CacheMetrics(**self._m, **self._t)
