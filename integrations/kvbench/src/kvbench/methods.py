"""Method discovery: packages register ``name -> factory(ratio) -> kvcore.Compressor`` under the
``kvcompress.methods`` entry-point group (a dict per package, e.g. ``kv_baselines.registry:METHODS``)."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Callable

from kvcore import Compressor

GROUP = "kvcompress.methods"


def discover() -> dict[str, Callable[[float], Compressor]]:
    """All registered methods, by name; a name registered twice is an error."""
    found: dict[str, Callable[[float], Compressor]] = {}
    for ep in entry_points(group=GROUP):
        table = ep.load()
        if not isinstance(table, dict):
            raise TypeError(f"entry point {ep.name} ({ep.value}) must load a dict name -> factory(ratio)")
        for name, factory in table.items():
            if name in found:
                raise ValueError(f"method {name!r} is registered twice (again by entry point {ep.name})")
            found[name] = factory
    return found


def build(name: str, ratio: float, registry: dict[str, Callable[[float], Compressor]] | None = None) -> Compressor:
    """The compressor registered as ``name`` at ``ratio``."""
    registry = discover() if registry is None else registry
    if name not in registry:
        raise ValueError(f"unknown method {name!r}; registered: {sorted(registry)}")
    comp = registry[name](ratio)
    if not isinstance(comp, Compressor):
        raise TypeError(f"method {name!r} returned {type(comp).__name__}, not a kvcore.Compressor")
    return comp
