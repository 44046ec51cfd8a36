"""kv_sglang: a compressed HiCache L3 storage backend for SGLang.

Load it with SGLang's dynamic storage backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvcompress", "module_path": "kv_sglang",
        "class_name": "KVCompressStorage", "codec": "kivi-4", "cpu_bytes": 8589934592}'

:class:`KVCompressStorage` needs SGLang importable and is loaded lazily, so ``import kv_sglang`` (the settings and the
page-layout helpers) works without the engine.
"""

from kv_sglang.layout import LAYOUTS, PageGeometry
from kv_sglang.settings import StorageSettings

__all__ = ["LAYOUTS", "KVCompressStorage", "PageGeometry", "StorageSettings"]


def __getattr__(name: str):
    if name == "KVCompressStorage":
        from kv_sglang.storage import KVCompressStorage

        return KVCompressStorage
    raise AttributeError(f"module 'kv_sglang' has no attribute {name!r}")
