"""kvpages: the engine-independent serving layer for compressed KV pages.

* :class:`PageCodec` -- a page ``[tokens, kv_heads, head_dim]`` of keys and values to a framed blob and back;
  built-ins ``"lossless"`` (bit-exact), ``"kivi-4"``, ``"kivi-2"`` (KIVI grouping) and ``"int8"``; more codecs from
  the ``kvcompress.codecs`` entry-point group. :func:`codec` / :func:`codec_names`.
* :func:`frame` / :func:`unframe` -- magic, version, codec hash, length and blake2b checksum around every payload;
  damage raises :class:`CorruptEntry` (a ``ValueError``), which readers treat as a miss.
* :class:`TieredStore` -- thread-safe LRU over a byte budget in CPU memory, spilling to an optional disk directory.
* :class:`PageCache` -- a codec over a store, with hit/miss/bytes/time metrics.
* :func:`chain_keys` -- one prefix-chained key per block of token ids, under a namespace (model, dtype, codec...).

Engine adapters (kv-vllm, kv-sglang) build on these; kvpages imports no engine.
"""

from kvpages.cache import CacheMetrics, PageCache
from kvpages.codec import CODEC_FORMAT_VERSION, PageCodec
from kvpages.errors import CorruptEntry
from kvpages.framing import FRAME_VERSION, frame, frame_codec_hash, unframe
from kvpages.keys import chain_keys
from kvpages.lossless import LosslessCodec
from kvpages.registry import ENTRY_POINT_GROUP, codec, codec_names
from kvpages.tiered import StoreMetrics, TieredStore
from kvpages.uniform import UniformPageCodec

__all__ = [
    "CODEC_FORMAT_VERSION",
    "ENTRY_POINT_GROUP",
    "FRAME_VERSION",
    "CacheMetrics",
    "CorruptEntry",
    "LosslessCodec",
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
    "unframe",
]
