"""Find every tensor an object holds, to check ``Store.nbytes`` against the memory really reachable from it."""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Iterator

import torch

from kvcore.memory import storage_bytes

_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, str, bytes)


def reachable_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors reachable from ``obj`` through attributes (``__dict__``, ``__slots__``, dataclass fields),
    lists, tuples, sets and dicts (keys and values). Each object is visited once, so cycles are fine."""
    seen: set[int] = set()
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, _OPAQUE) or x is None:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        else:
            if dataclasses.is_dataclass(x):
                stack.extend(getattr(x, f.name, None) for f in dataclasses.fields(x))
            stack.extend(getattr(x, "__dict__", {}).values())
            for cls in type(x).__mro__:
                slots = cls.__dict__.get("__slots__", ())
                stack.extend(getattr(x, s, None) for s in ((slots,) if isinstance(slots, str) else slots))


def reachable_bytes(obj: Any, device: torch.device | str | None = None) -> int:
    """Bytes of the distinct storages of every tensor reachable from ``obj`` (on ``device`` if given)."""
    return storage_bytes(reachable_tensors(obj), device)
