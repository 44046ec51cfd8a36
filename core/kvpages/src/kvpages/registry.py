"""Codecs by name: the built-ins and third-party codecs from the ``kvcompress.codecs`` entry-point group.

A package adds codecs with an entry point whose object is a mapping ``name -> factory(**options) -> PageCodec``::

    [project.entry-points."kvcompress.codecs"]
    mymethod = "my_package.codecs:CODECS"

kvpages never imports method packages; installing one makes its codecs available to every engine adapter.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any

from kvpages.codec import PageCodec
from kvpages.lossless import LosslessCodec
from kvpages.uniform import int8, kivi

ENTRY_POINT_GROUP = "kvcompress.codecs"

BUILTIN: dict[str, Callable[..., PageCodec]] = {
    "lossless": LosslessCodec,
    "kivi-4": lambda **options: kivi(4, **options),
    "kivi-2": lambda **options: kivi(2, **options),
    "int8": int8,
}


def _factories() -> dict[str, Callable[..., PageCodec]]:
    found = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            table = ep.load()
        except ImportError as exc:  # a package's metadata without its code: its codecs are missing, the rest work
            warnings.warn(
                f"kvpages: the codecs of entry point {ep.name!r} ({ep.value}) cannot be imported and are skipped: "
                f"{exc}",
                RuntimeWarning,
                stacklevel=3,
            )
            continue
        if not isinstance(table, Mapping):
            raise TypeError(
                f"entry point {ep.name!r} of {ENTRY_POINT_GROUP!r} must load a mapping name -> codec factory, "
                f"got {type(table).__name__}"
            )
        for name, factory in table.items():
            if name in found and found[name] is not factory:
                raise ValueError(f"codec name {name!r} from entry point {ep.name!r} is already registered")
            found[name] = factory
    return found


def codec_names() -> list[str]:
    """Sorted names of every available codec (built-in and installed through entry points)."""
    return sorted(_factories())


def codec(name: str, **options: Any) -> PageCodec:
    """Build the codec registered as ``name`` with ``options`` (passed to its factory).

    Raises
    ------
    ValueError
        Unknown name (the message lists the available names) or invalid options.
    """
    if not isinstance(name, str):
        raise TypeError(f"codec name must be a str, got {type(name).__name__}")
    factories = _factories()
    if name not in factories:
        raise ValueError(f"unknown codec {name!r}; available: {', '.join(sorted(factories))}")
    try:
        built = factories[name](**options)
    except TypeError as e:
        raise ValueError(f"invalid options {sorted(options)} for codec {name!r}: {e}") from None
    if not isinstance(built, PageCodec):
        raise TypeError(f"codec factory {name!r} returned {type(built).__name__}, not a kvpages.PageCodec")
    return built
