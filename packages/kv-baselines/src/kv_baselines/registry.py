"""Entry-point registry (group ``kvcompress.methods``): name -> factory(ratio) -> Compressor.

Quantization-only methods take ``ratio`` too: 0 gives plain KIVI, a ratio above 0 composes SnapKV eviction
with KIVI quantization of what is kept.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcore import Compressor

from kv_baselines import compressors as c


def _kivi(bits: int) -> Callable[[float], Compressor]:
    def make(ratio: float = 0.0) -> Compressor:
        return c.kivi(bits) if ratio == 0 else c.snapkv_kivi(ratio, bits)

    return make


METHODS: dict[str, Callable[[float], Compressor]] = {
    "full": lambda ratio=0.0: c.full(),
    "random": c.random,
    "knorm": c.knorm,
    "streaming_llm": c.streaming_llm,
    "snapkv": c.snapkv,
    "h2o": c.h2o,
    "kivi-4": _kivi(4),
    "kivi-2": _kivi(2),
}
