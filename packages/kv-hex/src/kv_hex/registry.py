"""The methods kv-hex registers (entry-point group ``kvcompress.methods``, see :mod:`kvcore.registry`).

HEX evicts nothing, so every entry has a fixed budget (``budgets`` empty; the registry builds it with its default).
"""

from __future__ import annotations

from kv_hex import compressor as c
from kvcore.registry import Method

__all__ = ["METHODS"]

METHODS: tuple[Method, ...] = (
    Method("hex-3", lambda budget: c.hex(3), "HEX-3: expander + global heavy hitters in fp16, 3-bit KCVT", frozenset()),
    Method("hex-4", lambda budget: c.hex(4), "HEX-4: expander + global heavy hitters in fp16, 4-bit KCVT", frozenset()),
    Method(
        "kcvt-3", lambda budget: c.kcvt(3), "KCVT 3-bit: keys per channel, values per token (HEX Table 4)", frozenset()
    ),
    Method(
        "kcvt-4", lambda budget: c.kcvt(4), "KCVT 4-bit: keys per channel, values per token (HEX Table 4)", frozenset()
    ),
    Method(
        "hex-expander-only-3", lambda budget: c.expander_only(3), "HEX-3 ablation: expander overlay only", frozenset()
    ),
    Method("hex-h2o-only-3", lambda budget: c.h2o_only(3), "HEX-3 ablation: heavy hitters + recent only", frozenset()),
    Method(
        "hex-random-mask-3",
        lambda budget: c.random_mask(3),
        "HEX-3 with a random unstructured mask of the expander's density (control)",
        frozenset(),
    ),
)
