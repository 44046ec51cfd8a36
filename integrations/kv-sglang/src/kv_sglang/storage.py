"""``KVCompressStorage``: an SGLang HiCache L3 storage backend that stores pages through a kvpages codec."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kv_sglang.layout import PageGeometry
from kv_sglang.settings import StorageSettings

logger = logging.getLogger(__name__)


class KVCompressStorage(HiCacheStorage):
    """HiCache L3 backend: pages encoded by a ``kvpages`` codec in a byte-budgeted CPU tier and an optional disk tier.

    SGLang creates it through ``StorageBackendFactory`` as ``KVCompressStorage(storage_config, kwargs)`` from
    ``--hicache-storage-backend dynamic`` and the JSON of ``--hicache-storage-backend-extra-config``
    (:class:`~kv_sglang.StorageSettings` lists our keys). Bad settings raise at creation.

    * Flat interface (``interface_v1`` 0): ``set``/``batch_set`` receive ``get_data_page(index)`` of the host pool,
      ``get``/``batch_get`` fill the flat page SGLang hands in (``get_dummy_flat_data_page()``).
    * Zero-copy interface (``interface_v1`` 1): ``batch_set_v1``/``batch_get_v1`` read and write the registered host
      pool's pages in place (layouts ``layer_first``, ``page_first``, ``page_first_direct``).

    A missing page, or one whose blob fails its checksum or was written with another codec configuration, is a miss
    (``None`` / ``False``) and SGLang recomputes it. ``batch_exists`` returns the length of the leading run of keys
    held. Keys are namespaced by the model, the TP/PP rank and the page geometry; the store key also carries the
    codec's config hash (:class:`kvpages.PageCache`).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        self.storage_config = storage_config
        extra = getattr(storage_config, "extra_config", None) if storage_config is not None else None
        self.settings = StorageSettings.from_extra_config(extra)
        self.cache = self.settings.build_cache()
        self.geometry: PageGeometry | None = None
        self._rank_ns = {
            "model": str(getattr(storage_config, "model_name", None) or ""),
            "tp": f"{getattr(storage_config, 'tp_rank', 0)}/{getattr(storage_config, 'tp_size', 1)}",
            "pp": f"{getattr(storage_config, 'pp_rank', 0)}/{getattr(storage_config, 'pp_size', 1)}",
        }
        self._prefix = ""
        logger.info("kv_sglang storage: codec %s, %r", self.settings.codec, self.cache.store)

    # ---------------------------------------------------------------------------------------------- registration
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Called by SGLang's cache controller right after creation: fixes the page geometry and key namespace."""
        geometry = PageGeometry.of_pool(mem_pool_host)
        if not self.cache.codec.lossless and geometry.page_size < 16:
            logger.warning(
                "kv_sglang: page_size %d with lossy codec %s: per-channel key groups over so few tokens store "
                "more than they save; use --page-size 64",
                geometry.page_size,
                self.settings.codec,
            )
        super().register_mem_pool_host(mem_pool_host)
        self.geometry = geometry
        ns = {**self._rank_ns, **geometry.namespace()}
        self._prefix = hashlib.blake2b(json.dumps(ns, sort_keys=True).encode(), digest_size=8).hexdigest() + ":"

    def _geometry(self) -> PageGeometry:
        if self.geometry is None:
            raise RuntimeError("kv_sglang: no host pool registered yet (SGLang calls register_mem_pool_host first)")
        return self.geometry

    def _key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str, got {key!r}")
        self._geometry()
        return self._prefix + key

    # ------------------------------------------------------------------------------------------- flat interface
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page (``get_data_page(index)`` of the host pool); True when stored or already held."""
        g, skey = self._geometry(), self._key(key)
        if self.cache.exists(skey):
            return True
        if not isinstance(value, torch.Tensor) or value.numel() != g.page_elements or value.dtype != g.dtype:
            raise ValueError(
                f"value must be a {g.dtype} page of {g.page_elements} elements, got "
                f"{type(value).__name__}{'' if not isinstance(value, torch.Tensor) else tuple(value.shape)}"
            )
        return self._save(skey, *g.to_kv(value))

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """``set`` for each page; True when every page was stored."""
        if values is None or len(values) != len(keys):
            raise ValueError(f"values must hold one page per key ({len(keys)})")
        return all([self.set(k, v) for k, v in zip(keys, values)])

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The flat page under ``key`` written into ``target_location`` (a new tensor when None), or None."""
        g, skey = self._geometry(), self._key(key)
        kv = self.cache.load(skey)
        if kv is None:
            return None
        out = target_location
        if out is None:
            out = torch.empty(g.page_elements, dtype=g.dtype)
        elif not isinstance(out, torch.Tensor) or out.numel() != g.page_elements or out.dtype != g.dtype:
            raise ValueError(f"target_location must be a {g.dtype} tensor of {g.page_elements} elements")
        g.from_kv(*kv, out)
        return out

    def batch_get(self, keys, target_locations=None, target_sizes=None) -> list[torch.Tensor | None]:
        """``get`` for each key (None for a miss)."""
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, targets)]

    def exists(self, key: str) -> bool:
        return self.cache.exists(self._key(key))

    def batch_exists(self, keys, extra_info=None) -> int:
        """Length of the leading run of ``keys`` held (SGLang loads that prefix)."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    # -------------------------------------------------------------------------------------- zero-copy interface
    def _page_indices(self, keys, host_indices) -> list[int]:
        g = self._geometry()
        if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != len(keys) * g.page_size:
            raise ValueError(f"host_indices must hold page_size ({g.page_size}) indices per key ({len(keys)} keys)")
        return host_indices.reshape(-1)[:: g.page_size].tolist()

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Encode the host pool's pages at ``host_indices`` (``page_size`` token indices per key) in place."""
        g, pool = self._geometry(), self.mem_pool_host
        out = []
        for key, index in zip(keys, self._page_indices(keys, host_indices)):
            skey = self._key(key)
            out.append(self.cache.exists(skey) or self._save(skey, *g.to_kv(g.host_page(pool.kv_buffer, index))))
        return out

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Decode pages straight into the host pool at ``host_indices``; False for a miss (the page is untouched)."""
        g, pool = self._geometry(), self.mem_pool_host
        out = []
        for key, index in zip(keys, self._page_indices(keys, host_indices)):
            kv = self.cache.load(self._key(key))
            if kv is not None:
                g.from_kv(*kv, g.host_page(pool.kv_buffer, index))
            out.append(kv is not None)
        return out

    # ---------------------------------------------------------------------------------------------------- misc
    def _save(self, skey: str, keys: torch.Tensor, values: torch.Tensor) -> bool:
        try:
            self.cache.save(skey, keys, values)
        except ValueError as e:  # e.g. a non-finite page under a lossy codec: not cached, recomputed later
            logger.warning("kv_sglang: page %s not stored: %s", skey, e)
            return False
        return True

    def clear(self) -> None:
        self.cache.store.clear()

    def get_stats(self) -> dict[str, Any]:
        """Page-cache and store metrics (hits, misses, corrupt, bytes stored vs fp16, per-tier bytes, times)."""
        return {
            **self.cache.metrics.as_dict(),
            **{f"store_{k}": v for k, v in self.cache.store.metrics.as_dict().items()},
        }
