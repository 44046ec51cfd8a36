"""The methods kv-hex registers (entry-point group ``kvcompress.methods``, see :mod:`kvcore.registry`).

HEX evicts nothing, so every entry has a fixed budget (``budgets`` empty; the registry builds it with its default).
"""

from __future__ import annotations

from collections.abc import Callable

from kv_hex import compressor as c
from kvcore import Budget, Compressor
from kvcore.registry import Method

__all__ = ["METHODS"]


def _fixed(make: Callable[[], Compressor]) -> Callable[[Budget], Compressor]:
    def factory(budget: Budget) -> Compressor:
        return make()

    return factory


def _method(name: str, make: Callable[[], Compressor], description: str) -> Method:
    return Method(name, _fixed(make), description, budgets=frozenset())


METHODS: tuple[Method, ...] = (
    _method("hex-3", lambda: c.hex(3), "HEX-3: expander + global heavy hitters in fp16, 3-bit KCVT (HEX §4.2)"),
    _method("hex-4", lambda: c.hex(4), "HEX-4: expander + global heavy hitters in fp16, 4-bit KCVT (HEX §4.2)"),
    _method("kcvt-3", lambda: c.kcvt(3), "KCVT 3-bit: keys per channel, values per token (HEX Table 4)"),
    _method("kcvt-4", lambda: c.kcvt(4), "KCVT 4-bit: keys per channel, values per token (HEX Table 4)"),
    _method("hex-expander-only-3", lambda: c.expander_only(3), "HEX-3 ablation: expander overlay only (Table 4)"),
    _method("hex-h2o-only-3", lambda: c.h2o_only(3), "HEX-3 ablation: heavy hitters + recent only (Table 4)"),
    _method(
        "hex-random-mask-3",
        lambda: c.random_mask(3),
        "HEX-3 with a random unstructured mask of the expander's density (the §3.2 control)",
    ),
)
