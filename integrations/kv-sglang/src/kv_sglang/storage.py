"""``KVCompressStorage``: an SGLang HiCache L3 storage backend that stores pages through a kvpages codec."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

import kvpages
from kv_sglang.layout import PageGeometry
from kv_sglang.settings import StorageSettings

logger = logging.getLogger(__name__)

FAILED_LOAD_REASONS = ("absent", "store", "corrupt", "unexpected")
"""Why a load missed (``failed_loads_<reason>`` in :meth:`KVCompressStorage.metrics`):

* ``absent`` -- no entry under the key (never stored, evicted, refused);
* ``store`` -- the store's index held the key but it returned nothing: a file vanished, could not be read, or failed
  the store's checksum (the store's ``fault_<kind>`` says which);
* ``corrupt`` -- the codec rejected the blob (damaged frame, another codec configuration, wrong page shape);
  the entry is deleted;
* ``unexpected`` -- any other exception, caught at the SGLang boundary.
"""

NOT_STORED_REASONS = ("nonfinite", "codec", "store", "unexpected")
"""Why a page was not stored (``not_stored_<reason>``): a NaN/inf page under a lossy codec, a page the codec refused
for another reason, the store refused it (larger than every tier, full disk, I/O or permission error; the store's
``fault_<kind>`` says which), or any other exception."""

_METRICS_MODULE = "sglang.srt.observability.metrics_collector"
_GIB = float(1 << 30)
LOG_EVERY_SECONDS = 60.0
"""``get_stats`` logs the non-zero cumulative :meth:`KVCompressStorage.metrics` at INFO at most this often."""


@dataclass
class _StorageMetrics:
    """Stand-in with the fields of SGLang 0.5.23's ``StorageMetrics``, used only while that module is not loaded."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


def _storage_metrics_type() -> type:
    """SGLang's ``StorageMetrics`` when its module is loaded (always so in a server), else :class:`_StorageMetrics`.

    SGLang's scheduler imports ``sglang.srt.observability.metrics_collector`` before it ever calls ``get_stats``
    and asserts ``isinstance(result, StorageMetrics)``; importing it here would pull in SGLang's model configs
    (torchvision, ...) in processes that only use the storage classes.
    """
    module = sys.modules.get(_METRICS_MODULE)
    cls = getattr(module, "StorageMetrics", None)
    return cls if isinstance(cls, type) else _StorageMetrics


class KVCompressStorage(HiCacheStorage):
    """HiCache L3 backend: pages encoded by a ``kvpages`` codec in a byte-budgeted CPU tier and an optional disk tier.

    SGLang creates it through ``StorageBackendFactory`` as ``KVCompressStorage(storage_config, kwargs)`` from
    ``--hicache-storage-backend dynamic`` and the JSON of ``--hicache-storage-backend-extra-config``
    (:class:`~kv_sglang.StorageSettings` lists our keys). Bad settings raise at creation.

    * Flat interface (``interface_v1`` 0): ``set``/``batch_set`` receive ``get_data_page(index)`` of the host pool,
      ``get``/``batch_get`` fill the flat page SGLang hands in (``get_dummy_flat_data_page()``).
    * Zero-copy interface (``interface_v1`` 1): ``batch_set_v1``/``batch_get_v1`` read and write the registered host
      pool's pages in place (layouts ``layer_first``, ``page_first``, ``page_first_direct``).

    Keys are SGLang's page hashes, which chain every earlier page of the sequence and, in SGLang 0.5.23, the
    request's ``extra_key`` (LoRA id) and ``cache_salt`` (``mem_cache/utils.py::get_storage_hash_str``); the backend
    adds the model, the TP/PP rank, the page geometry and the codec's config hash.

    **Faults never raise into SGLang.** Every method SGLang calls turns a fault -- a full disk, an I/O error, a file
    deleted or damaged under the store, a page the codec refuses (NaN/inf under a lossy codec), a corrupt blob, any
    unexpected exception -- into "not stored" (``False``), a miss (``None`` / ``False``, the target page untouched)
    or a shorter ``batch_exists`` prefix, and SGLang recomputes. Each fault is counted by kind (:meth:`metrics`,
    ``fault_<kind>``) and the first of each kind is logged. Caller bugs still raise: a value of the wrong shape or
    dtype, ``host_indices`` of the wrong length or alignment, a non-string key (``ValueError`` / ``TypeError``),
    or a call before ``register_mem_pool_host`` (``RuntimeError``).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        self.storage_config = storage_config
        extra = getattr(storage_config, "extra_config", None) if storage_config is not None else None
        self.settings = StorageSettings.from_extra_config(extra)
        self.cache = self.settings.build_cache()
        self.geometry: PageGeometry | None = None
        self.faults = kvpages.FaultLog(logger, "kv_sglang storage")
        self._rank_ns = {
            "model": str(getattr(storage_config, "model_name", None) or ""),
            "tp": f"{getattr(storage_config, 'tp_rank', 0)}/{getattr(storage_config, 'tp_size', 1)}",
            "pp": f"{getattr(storage_config, 'pp_rank', 0)}/{getattr(storage_config, 'pp_size', 1)}",
        }
        self._prefix = ""
        self._lock = threading.Lock()
        self._counts = {
            "hits": 0,
            **{f"failed_loads_{r}": 0 for r in FAILED_LOAD_REASONS},
            "stored_pages": 0,
            "already_held": 0,
            **{f"not_stored_{r}": 0 for r in NOT_STORED_REASONS},
            "stored_bytes": 0,
            "fp16_bytes": 0,
            "loaded_bytes": 0,
        }
        self._seconds = {"encode_seconds": 0.0, "decode_seconds": 0.0}
        self._io_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._io: dict[str, list] = {k: [] for k in _StorageMetrics.__dataclass_fields__}
        self._logged_at: float | None = None
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
        """The store key of SGLang's page hash ``key`` (namespace, codec hash); TypeError for a non-string key."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str, got {key!r}")
        self._geometry()
        return self.cache.store_key(self._prefix + key)

    def _keys(self, keys) -> list[str]:
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__"):
            raise TypeError(f"keys must be a list of str, got {type(keys).__name__}")
        return [self._key(k) for k in keys]

    # ------------------------------------------------------------------------------------ counting and faults
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def _fault(self, kind: str, what: str, exc: BaseException) -> None:
        with contextlib.suppress(Exception):  # logging must not turn a fault into an exception either
            self.faults.record(kind, what, exc)

    def _record_io(self, pages_name: str, bw_name: str, pages: int, nbytes: int, seconds: float) -> None:
        if not self._io_metrics or pages == 0:
            return
        with self._lock:
            self._io[pages_name].append(pages)
            if nbytes and seconds > 0:
                self._io[bw_name].append(nbytes / seconds / _GIB)

    # ------------------------------------------------------------------------------------- save and load (core)
    def _held(self, skey: str) -> bool:
        try:
            return self.cache.store.contains(skey)
        except Exception as exc:
            self._fault("unexpected", "a lookup failed: reported as not held", exc)
            return False

    def _save(self, skey: str, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Encode and store one page; the stored blob's length, 0 when not stored (counted by reason)."""
        codec = self.cache.codec
        t0 = time.perf_counter()
        try:
            blob = codec.encode(keys, values)
        except kvpages.NonFinitePage as exc:
            return self._not_stored("nonfinite", "a page with NaN/inf was not stored (lossy codec)", exc)
        except (ValueError, TypeError) as exc:
            return self._not_stored("codec", "the codec refused a page: not stored", exc)
        except Exception as exc:
            return self._not_stored("unexpected", "encoding a page failed: not stored", exc)
        dt = time.perf_counter() - t0
        try:
            ok = self.cache.store.put(skey, blob)
        except Exception as exc:
            return self._not_stored("unexpected", "storing a page failed: not stored", exc)
        if not ok:  # the store counted and logged the fault (over_budget, disk_full, io_error, ...)
            self._count("not_stored_store")
            return 0
        fp16 = codec.fp16_bytes(*keys.shape)
        with self._lock:
            self._counts["stored_pages"] += 1
            self._counts["stored_bytes"] += len(blob)
            self._counts["fp16_bytes"] += fp16
            self._seconds["encode_seconds"] += dt
        return len(blob)

    def _not_stored(self, reason: str, what: str, exc: BaseException) -> int:
        self._fault(reason, what, exc)
        self._count(f"not_stored_{reason}")
        return 0

    def _save_page(self, skey: str, page: torch.Tensor) -> tuple[bool, int]:
        """``(held afterwards, bytes written)`` for one page (flat, or a host-buffer slice) of the registered layout."""
        if self._held(skey):
            self._count("already_held")
            return True, 0
        try:
            k, v = self._geometry().to_kv(page)
        except Exception as exc:  # the page was checked by the caller: a failure here is not the caller's
            return False, self._not_stored("unexpected", "reading a host page failed: not stored", exc)
        n = self._save(skey, k, v)
        return n > 0, n

    def _load_into(self, skey: str, out: torch.Tensor | None) -> tuple[torch.Tensor | None, int]:
        """Decode the page under ``skey`` into ``out`` (a flat page or a host-buffer slice; a new flat page when None).

        Returns ``(out, blob bytes)``, or ``(None, 0)`` for a miss, counted by reason; a miss writes nothing.
        """
        g, codec, store = self._geometry(), self.cache.codec, self.cache.store
        try:
            held = store.contains(skey)
            blob = store.get(skey)
        except Exception as exc:
            return self._miss("unexpected", "a load failed: recomputed", exc)
        if blob is None:  # a held key the store could not serve: it counted the fault by kind
            self._count("failed_loads_store" if held else "failed_loads_absent")
            return None, 0
        t0 = time.perf_counter()
        try:
            k, v = codec.decode(blob)
            expect = (g.page_size, g.layers * g.heads, g.head_dim)
            if tuple(k.shape) != expect or tuple(v.shape) != expect:
                raise kvpages.CorruptEntry(f"decoded page is {tuple(k.shape)}, expected {expect}")
        except kvpages.CorruptEntry as exc:
            try:
                store.delete(skey)
            except Exception as exc2:
                self._fault("unexpected", "a corrupt entry could not be deleted", exc2)
            return self._miss("corrupt", "a corrupt page was dropped: recomputed", exc)
        except Exception as exc:
            return self._miss("unexpected", "decoding a page failed: recomputed", exc)
        dt = time.perf_counter() - t0
        try:
            if out is None:
                out = torch.empty(g.page_elements, dtype=g.dtype)
            g.from_kv(k.to(g.dtype), v.to(g.dtype), out)
        except Exception as exc:
            return self._miss("unexpected", "writing a loaded page failed: recomputed", exc)
        with self._lock:
            self._counts["hits"] += 1
            self._counts["loaded_bytes"] += len(blob)
            self._seconds["decode_seconds"] += dt
        return out, len(blob)

    def _miss(self, reason: str, what: str, exc: BaseException) -> tuple[None, int]:
        self._fault(reason, what, exc)
        self._count(f"failed_loads_{reason}")
        return None, 0

    # ------------------------------------------------------------------------------------------- flat interface
    def _check_flat(self, name: str, x: Any, optional: bool) -> None:
        g = self._geometry()
        if x is None and optional:
            return
        if not isinstance(x, torch.Tensor) or x.numel() != g.page_elements or x.dtype != g.dtype:
            got = type(x).__name__ if not isinstance(x, torch.Tensor) else f"{x.dtype} {tuple(x.shape)}"
            raise ValueError(f"{name} must be a {g.dtype} page of {g.page_elements} elements, got {got}")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page (``get_data_page(index)`` of the host pool).

        Returns
        -------
        bool
            True when stored or already held; False when not stored (a fault, counted).
        """
        skey = self._key(key)
        self._check_flat("value", value, optional=False)
        t0 = time.perf_counter()
        ok, n = self._save_page(skey, value)
        self._record_io("backup_pgs", "backup_bandwidth", int(n > 0), n, time.perf_counter() - t0)
        return ok

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """``set`` for each page; True when every page is held afterwards."""
        skeys = self._keys(keys)
        if values is None or len(values) != len(skeys):
            raise ValueError(f"values must hold one page per key ({len(skeys)})")
        for v in values:
            self._check_flat("values[i]", v, optional=False)
        t0, written, nbytes, ok = time.perf_counter(), 0, 0, True
        for skey, value in zip(skeys, values):
            held, n = self._save_page(skey, value)
            ok &= held
            written, nbytes = written + (n > 0), nbytes + n
        self._record_io("backup_pgs", "backup_bandwidth", written, nbytes, time.perf_counter() - t0)
        return ok

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The flat page under ``key`` written into ``target_location`` (a new tensor when None), or None on a miss.

        A miss (absent, corrupt, unreadable: counted by reason) leaves ``target_location`` untouched.
        """
        skey = self._key(key)
        self._check_flat("target_location", target_location, optional=True)
        t0 = time.perf_counter()
        out, n = self._load_into(skey, target_location)
        self._record_io("prefetch_pgs", "prefetch_bandwidth", 1, n, time.perf_counter() - t0)
        return out

    def batch_get(self, keys, target_locations=None, target_sizes=None) -> list[torch.Tensor | None]:
        """``get`` for each key (None for a miss)."""
        skeys = self._keys(keys)
        targets = target_locations if target_locations is not None else [None] * len(skeys)
        if len(targets) != len(skeys):
            raise ValueError(f"target_locations must hold one page per key ({len(skeys)}), got {len(targets)}")
        for t in targets:
            self._check_flat("target_locations[i]", t, optional=True)
        t0, nbytes, out = time.perf_counter(), 0, []
        for skey, target in zip(skeys, targets):
            page, n = self._load_into(skey, target)
            out.append(page)
            nbytes += n
        self._record_io("prefetch_pgs", "prefetch_bandwidth", len(skeys), nbytes, time.perf_counter() - t0)
        return out

    def exists(self, key: str) -> bool:
        """Whether the store's index holds ``key`` (a file removed behind its back is found by the load: a miss)."""
        return self._held(self._key(key))

    def batch_exists(self, keys, extra_info=None) -> int:
        """Length of the leading run of ``keys`` held (SGLang prefetches that prefix).

        With a disk directory, entries other processes added or evicted since the last call are taken in first,
        so a page another TP rank or server wrote is found and a page it evicted is not offered.
        """
        skeys = self._keys(keys)
        if self.cache.store.disk_dir is not None:
            try:
                self.cache.store.take_changes()
            except Exception as exc:
                self._fault("unexpected", "refreshing the shared disk index failed", exc)
        for i, skey in enumerate(skeys):
            if not self._held(skey):
                return i
        return len(skeys)

    # -------------------------------------------------------------------------------------- zero-copy interface
    def _host_pages(self, keys, host_indices) -> tuple[list[str], list[torch.Tensor]]:
        """Store keys and the host pool's page slices for ``keys`` at ``host_indices`` (argument errors raise)."""
        g, skeys = self._geometry(), self._keys(keys)
        if not isinstance(host_indices, torch.Tensor) or host_indices.numel() != len(skeys) * g.page_size:
            got = host_indices.numel() if isinstance(host_indices, torch.Tensor) else type(host_indices).__name__
            raise ValueError(
                f"host_indices must hold page_size ({g.page_size}) indices per key ({len(skeys)} keys), got {got}"
            )
        starts = host_indices.reshape(-1)[:: g.page_size].tolist()
        buffer = self.mem_pool_host.kv_buffer
        pages = []
        for index in starts:
            try:
                page = g.host_page(buffer, int(index))
            except ValueError as exc:
                raise ValueError(f"host_indices: {exc}") from None
            if page.numel() != g.page_elements:
                raise ValueError(f"host_indices: page at {index} is outside the host pool")
            pages.append(page)
        return skeys, pages

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Encode the host pool's pages at ``host_indices`` (``page_size`` token indices per key) in place.

        Returns one bool per key: held afterwards (stored, or already held) or not stored (a fault, counted).
        """
        skeys, pages = self._host_pages(keys, host_indices)
        t0, written, nbytes, out = time.perf_counter(), 0, 0, []
        for skey, page in zip(skeys, pages):
            held, n = self._save_page(skey, page)
            out.append(held)
            written, nbytes = written + (n > 0), nbytes + n
        self._record_io("backup_pgs", "backup_bandwidth", written, nbytes, time.perf_counter() - t0)
        return out

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list[bool]:
        """Decode pages straight into the host pool at ``host_indices``; False for a miss (that page is untouched)."""
        skeys, pages = self._host_pages(keys, host_indices)
        t0, nbytes, out = time.perf_counter(), 0, []
        for skey, page in zip(skeys, pages):
            loaded, n = self._load_into(skey, page)
            out.append(loaded is not None)
            nbytes += n
        self._record_io("prefetch_pgs", "prefetch_bandwidth", len(skeys), nbytes, time.perf_counter() - t0)
        return out

    # ---------------------------------------------------------------------------------------------------- misc
    def clear(self) -> None:
        """Remove every entry this backend's store holds (a fault is counted, never raised)."""
        try:
            self.cache.store.clear()
        except Exception as exc:
            self._fault("unexpected", "clearing the store failed", exc)

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since creation (see ``docs/engines/sglang.md`` for each one's meaning).

        ``hits``, ``misses`` (= the sum of ``failed_loads_<reason>``, reasons in :data:`FAILED_LOAD_REASONS`),
        ``stored_pages``, ``already_held``, ``not_stored_<reason>`` (:data:`NOT_STORED_REASONS`), ``stored_bytes``
        (blob bytes written), ``fp16_bytes`` (the same pages in fp16), ``bytes_saved`` (their difference),
        ``compression`` (their ratio), ``loaded_bytes``, ``encode_seconds``, ``decode_seconds``, every
        ``fault_<kind>`` of :data:`kvpages.FAULT_KINDS` (this backend's and its store's, summed) and the store's
        own metrics as ``store_<name>`` (per-tier bytes and entries, evictions, its faults by kind).
        """
        with self._lock:
            counts, seconds = dict(self._counts), dict(self._seconds)
        store = self.cache.store.metrics
        faults = self.faults.counts()
        misses = sum(counts[f"failed_loads_{r}"] for r in FAILED_LOAD_REASONS)
        return {
            "hits": counts.pop("hits"),
            "misses": misses,
            **counts,
            "bytes_saved": counts["fp16_bytes"] - counts["stored_bytes"],
            "compression": counts["fp16_bytes"] / counts["stored_bytes"] if counts["stored_bytes"] else 0.0,
            **seconds,
            **{k: faults[k] + store.faults.get(k, 0) for k in faults},
            **{f"store_{k}": v for k, v in store.as_dict().items()},
        }

    def get_stats(self):
        """What SGLang's scheduler logs when ``--enable-metrics`` is on: a ``StorageMetrics``.

        SGLang 0.5.23 (``UnifiedRadixCache`` -> ``StorageMetricsCollector.log_storage_metrics``) asserts the type and
        histograms ``prefetch_pgs`` / ``backup_pgs`` (pages per batch call; backups count pages written, not
        pages already held) and ``prefetch_bandwidth`` / ``backup_bandwidth`` (GiB/s of stored, i.e. compressed,
        blob bytes over the call's wall time, encoding or decoding included). The lists hold the calls since the
        previous ``get_stats`` and are drained, as SGLang's own backends do; they are filled only when the
        storage config enables storage metrics (``HiCacheStorageConfig.enable_storage_metrics``, which SGLang sets
        from ``--enable-metrics``). The cumulative counters are in :meth:`metrics`; their non-zero
        values are logged at INFO at most every :data:`LOG_EVERY_SECONDS` from here.
        """
        now = time.monotonic()
        if self._logged_at is None or now - self._logged_at >= LOG_EVERY_SECONDS:
            self._logged_at = now
            try:
                summary = {k: v for k, v in self.metrics().items() if v}
                logger.info("kv_sglang storage metrics: %s", summary)
            except Exception as exc:
                self._fault("unexpected", "summarizing the metrics failed", exc)
        cls = _storage_metrics_type()
        with self._lock:
            io = {k: list(v) for k, v in self._io.items()}
            for v in self._io.values():
                v.clear()
        return cls(**io)
