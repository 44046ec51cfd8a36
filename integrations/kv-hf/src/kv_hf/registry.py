"""Entry-point registry of kv-hf (group ``kvcompress.methods``): methods whose scores need the model itself.

``kvzip``: KVzip context-reconstruction scores (query-agnostic), global top-k over layers and heads.
"""

from __future__ import annotations

from typing import Callable

from kvcore import Compressor

from kv_hf.kvzip_scorer import kvzip

METHODS: dict[str, Callable[[float], Compressor]] = {"kvzip": kvzip}
