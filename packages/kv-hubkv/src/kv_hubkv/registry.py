"""Entry-point registry (group ``kvcompress.methods``): name -> factory(ratio) -> Compressor.

Method packages never import each other (DESIGN.md §1), so the HubKV entries find their base method
through the same entry-point group at call time: ``METHODS["hubkv-snapkv"](0.9)`` is
``hubkv(<the registered "snapkv" factory>(0.9))``. If no installed package registers the base, the
factory raises a ``LookupError`` naming it. ``"hubkv"`` is HubKV over SnapKV (the paper's bases,
KVzip / Fast KVzip, are not available in this workspace yet).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

from kvcore import Compressor

from .compressor import hubkv

__all__ = ["METHODS", "base_factory"]

GROUP = "kvcompress.methods"


def base_factory(name: str) -> Callable[[float], Compressor]:
    """The factory registered as ``name`` by any other package of the ``kvcompress.methods`` group."""
    for ep in entry_points(group=GROUP):
        if ep.value.startswith(__name__.split(".")[0] + "."):
            continue  # our own entries
        methods = ep.load()
        if name in methods:
            return methods[name]
    raise LookupError(f"no installed package registers the base method {name!r} in entry-point group {GROUP!r}")


def _over(base_name: str) -> Callable[[float], Compressor]:
    def make(ratio: float) -> Compressor:
        return hubkv(base_factory(base_name)(ratio), ratio)

    make.__name__ = f"hubkv_{base_name}"
    make.__doc__ = f"HubKV over the registered {base_name!r} method at compression ratio ``ratio``."
    return make


METHODS: dict[str, Callable[[float], Compressor]] = {
    "hubkv": _over("snapkv"),
    "hubkv-snapkv": _over("snapkv"),
    "hubkv-h2o": _over("h2o"),
    "hubkv-kvzip": _over("kvzip"),
}
