"""Byte accounting: what tensors really hold, counted by storage so views and slack are not hidden.

:func:`storage_bytes` counts the distinct storages behind some tensors; :func:`reachable_tensors` walks an object
(a Store) to every tensor it holds, so ``Store.nbytes()`` can be checked against what is really held
(:func:`reachable_bytes`).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, str, bytes)


def storage_bytes(tensors: Iterable[torch.Tensor | None], device: torch.device | str | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (on ``device`` if given)."""
    want = None if device is None else torch.device(device)
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t is None:
            continue
        if want is not None and (t.device.type != want.type or (want.index is not None and t.device != want)):
            continue
        st = t.untyped_storage()
        seen[(str(t.device), st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def reachable_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through ``__dict__``, ``__slots__``, dataclass fields, lists, tuples, sets
    and dicts (keys and values); every object is visited once, so cycles are fine."""
    seen, stack = set(), [obj]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen or isinstance(x, _OPAQUE):
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            stack += [*x.keys(), *x.values()]
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack += list(x)
        else:
            if dataclasses.is_dataclass(x):
                stack += [getattr(x, f.name, None) for f in dataclasses.fields(x)]
            stack += list(vars(x).values()) if hasattr(x, "__dict__") else []
            for cls in type(x).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                stack += [getattr(x, s, None) for s in ((slots,) if isinstance(slots, str) else slots)]


def reachable_bytes(obj: Any, device: torch.device | str | None = None) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``obj`` (on ``device`` if given)."""
    return storage_bytes(reachable_tensors(obj), device)
