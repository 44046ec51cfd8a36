"""Count the host reads of tensor values a block of code makes: each one is a host sync on a GPU.

``item``, ``tolist``, ``int()`` / ``bool()`` / ``float()`` / ``operator.index`` of a tensor, ``nonzero``,
``unique``, ``masked_select``, boolean-mask indexing and assignment, ``repeat_interleave`` with tensor repeats (or
the one-argument form) and no ``output_size``, ``.cpu()`` and ``.to("cpu")``: on a GPU each waits for every kernel
queued before it, so a decode step that makes a few per layer runs at the launch latency of the whole model. Two
host-to-device copies wait the same way and are counted too: ``torch.tensor`` / ``torch.as_tensor`` of Python data
(a list, a number) with a ``device`` other than ``"cpu"`` (PyTorch copies pageable host memory to a GPU and then
synchronises the stream), and indexing with a Python list (the index is copied to the tensor's device). The
counter works on any device, so a CPU test can pin a hot path's reads down (``.to(device)`` with a device object
is device-generic code and is not counted; on a CPU run every tensor is a CPU tensor, so a read of a tensor a GPU
run would keep on the host, or a copy to a device that is the CPU, is counted too: an upper bound).

Examples
--------
>>> import torch
>>> from kvcore.testing.host_reads import HostReads
>>> x = torch.arange(4)
>>> with HostReads() as reads:
...     y = x * 2  # no read
...     n = int(y.sum())  # one read
>>> reads.total
1
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import ClassVar

import torch

__all__ = ["HostReads", "call_site"]

_LOCK = threading.Lock()
_ACTIVE: list[HostReads] = []


def call_site(depth: int = 2, skip: tuple[str, ...] = ()) -> str:
    """``module:line (function)`` of the first caller frame in a ``kv*`` package (else the first outside torch
    and this module), ``depth`` frames up; modules in ``skip`` are passed over."""
    frame, fallback = sys._getframe(depth), None
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        top = module.split(".")[0]
        if module != __name__ and module not in skip:
            if top.startswith("kv"):
                return f"{module}:{frame.f_lineno} ({frame.f_code.co_name})"
            if fallback is None and top not in ("torch", "functools", "contextlib"):
                fallback = f"{module}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return fallback or "?"


def _bool_index(index: object) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _list_index(index: object) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, list) for i in items)


def _host_data_to_device(data=None, *args, **kwargs) -> bool:
    """Python data (not a tensor) given a ``device`` that is not the literal ``"cpu"``."""
    device = kwargs.get("device")
    return device is not None and device != "cpu" and not isinstance(data, torch.Tensor)


def _tensor_repeats(_x, repeats=None, *args, **kwargs) -> bool:
    """Tensor repeats, or the one-argument form ``repeat_interleave(counts)``, without ``output_size``."""
    one_argument = repeats is None and isinstance(_x, torch.Tensor)
    return (one_argument or isinstance(repeats, torch.Tensor)) and kwargs.get("output_size") is None


def _to_cpu(_x, *args, **kwargs) -> bool:
    return any(isinstance(a, str) and a.startswith("cpu") for a in (*args, kwargs.get("device")))


# (owner, attribute, label, condition on the call's arguments or None)
_READS: tuple[tuple[object, str, str, Callable[..., bool] | None], ...] = (
    *((torch.Tensor, name, name, None) for name in ("item", "tolist", "__bool__", "__int__", "__float__")),
    *((torch.Tensor, name, name, None) for name in ("__index__", "nonzero", "unique", "masked_select", "cpu")),
    (torch.Tensor, "__getitem__", "bool-mask index", lambda self, index: _bool_index(index)),
    (torch.Tensor, "__setitem__", "bool-mask assign", lambda self, index, value: _bool_index(index)),
    (torch.Tensor, "__getitem__", "list index", lambda self, index: _list_index(index)),
    (torch.Tensor, "__setitem__", "list-index assign", lambda self, index, value: _list_index(index)),
    *((torch, name, f"torch.{name} to device", _host_data_to_device) for name in ("tensor", "as_tensor")),
    (torch.Tensor, "repeat_interleave", "repeat_interleave", _tensor_repeats),
    (torch.Tensor, "to", "to cpu", _to_cpu),
    *((torch, name, f"torch.{name}", None) for name in ("nonzero", "unique", "masked_select", "argwhere")),
    (torch, "repeat_interleave", "torch.repeat_interleave", _tensor_repeats),
)


def _install() -> list[tuple[object, str, object]]:
    saved = []
    for owner, name, label, when in _READS:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, _original=original, _label=label, _when=when, **kwargs):
            if _ACTIVE and (_when is None or _when(*args, **kwargs)):
                for counter in _ACTIVE:
                    counter.record(_label)
            return _original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, wrapper)
    return saved


class HostReads:
    """Context manager counting host reads (module doc) made inside it, by ``(call site, operation)``.

    Parameters
    ----------
    sites : bool
        Record where each read was made (:func:`call_site`; slower). Without, only :attr:`total` is kept.

    Attributes
    ----------
    total : int
        Reads counted while active and not :attr:`paused`.
    by_site : collections.Counter
        ``(site, operation) -> reads`` (with ``sites=True``).
    paused : bool
        Set to skip reads made by code that is not under test (e.g. an interpreter running a kernel).
    """

    _saved: ClassVar[list[tuple[object, str, object]]] = []

    def __init__(self, sites: bool = False) -> None:
        if not isinstance(sites, bool):
            raise TypeError(f"sites must be a bool, got {type(sites).__name__}")
        self.sites, self.total, self.by_site, self.paused = sites, 0, Counter(), False

    def record(self, label: str) -> None:
        if self.paused:
            return
        self.total += 1
        if self.sites:
            self.by_site[(call_site(3), label)] += 1

    def __enter__(self) -> HostReads:
        with _LOCK:
            if not _ACTIVE:
                HostReads._saved = _install()
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            _ACTIVE.remove(self)
            if not _ACTIVE:
                for owner, name, original in reversed(HostReads._saved):  # a name wrapped twice ends unwrapped
                    setattr(owner, name, original)
                HostReads._saved = []
