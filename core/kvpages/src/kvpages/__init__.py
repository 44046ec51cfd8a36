"""kvpages: the engine-independent serving layer for compressed KV pages.

* :class:`PageCodec` -- a page ``[tokens, kv_heads, head_dim]`` of keys and values to a framed blob and back;
  built-ins ``"lossless"`` (bit-exact), ``"kivi-4"``, ``"kivi-2"`` (KIVI grouping) and ``"int8"``; more codecs from
  the ``kvcompress.codecs`` entry-point group. :func:`codec` / :func:`codec_names`.
* :func:`frame` / :func:`unframe` -- magic, version, codec hash, length and blake2b checksum around every payload;
  damage raises :class:`CorruptEntry` (a ``ValueError``), which readers treat as a miss.
* :class:`TieredStore` -- thread- and process-safe LRU over a byte budget in CPU memory, spilling to an optional
  disk directory that several processes may share; faults (full disk, I/O errors, vanished or corrupt files,
  oversized entries) become misses or "not stored", counted by kind in a :class:`FaultLog`.
* :class:`PageCache` -- a codec over a store, with hit/miss/bytes/time metrics.
* :func:`chain_keys` -- one prefix-chained key per block of token ids, under a namespace (model, dtype, codec...).
* :func:`sink_score` -- a query-free token importance for codecs that keep some tokens at higher precision.

Engine adapters (kv-vllm, kv-sglang) build on these; kvpages imports no engine.
"""

from kvpages.byte_counts import ByteCounts
from kvpages.cache import CacheMetrics, PageCache
from kvpages.codec import CODEC_FORMAT_VERSION, PageCodec
from kvpages.errors import CorruptEntry
from kvpages.faults import FAULT_KINDS, FaultLog, NonFinitePage, os_fault_kind
from kvpages.framing import FRAME_VERSION, frame, frame_codec_hash, frame_length, unframe
from kvpages.importance import sink_score
from kvpages.keys import chain_keys, namespace_digest
from kvpages.lossless import LosslessCodec
from kvpages.registry import ENTRY_POINT_GROUP, codec, codec_names
from kvpages.tiered import StoreMetrics, TieredStore
from kvpages.uniform import UniformPageCodec

__all__ = [
    "CODEC_FORMAT_VERSION",
    "ENTRY_POINT_GROUP",
    "FAULT_KINDS",
    "FRAME_VERSION",
    "ByteCounts",
    "CacheMetrics",
    "CorruptEntry",
    "FaultLog",
    "LosslessCodec",
    "NonFinitePage",
    "PageCache",
    "PageCodec",
    "StoreMetrics",
    "TieredStore",
    "UniformPageCodec",
    "chain_keys",
    "codec",
    "codec_names",
    "frame",
    "frame_codec_hash",
    "frame_length",
    "namespace_digest",
    "os_fault_kind",
    "sink_score",
    "unframe",
]
