"""Work shared by the layers of one decode step: computed by the first layer, reused by the others.

Every layer of a step commits the same tokens at the same positions: the positions of the step's tokens and the
next true position of every row are the same tensors in each layer, so computing them per layer launched the same
few small kernels once per layer (3–5 per layer and step on a GPU, where a small model's decode is launch-bound).
:class:`StepMemo` keeps the last result of each computation with the inputs it came from, compared by identity for
tensors (and by their in-place version counter, so a tensor written in place since does not match) and by value
otherwise; a layer whose inputs are those of the previous call gets the same result object. Results are shared, so
they are never written in place (the layers replace their ``next_positions``, they do not edit it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

__all__ = ["STEP", "StepMemo"]


def _token(x: Any) -> tuple:
    if isinstance(x, torch.Tensor):
        return (x, x._version)
    return (None, x)


def _same(a: tuple, b: tuple) -> bool:
    """Tensors: the same object at the same version; anything else: equal values."""
    if len(a) != len(b):
        return False
    for (ta, va), (tb, vb) in zip(a, b):
        if ta is not None or tb is not None:
            if ta is not tb or va != vb:
                return False
        elif va != vb:
            return False
    return True


class StepMemo:
    """One remembered result per name (per thread), reused when the next call's inputs are the same.

    Examples
    --------
    >>> import torch
    >>> memo = StepMemo()
    >>> p = torch.arange(3)
    >>> a = memo.get("last", (p,), lambda: p.max() + 1)
    >>> memo.get("last", (p,), lambda: p.max() + 1) is a
    True
    >>> _ = p.add_(1)  # written in place: its version changed, so the result is computed again
    >>> int(memo.get("last", (p,), lambda: p.max() + 1))
    4
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, name: Hashable, inputs: tuple, compute: Callable[[], Any]) -> Any:
        """``compute()``'s result for ``inputs``, reused if the last call for ``name`` had the same inputs."""
        held = self._local.__dict__.setdefault("held", {})
        key = tuple(_token(x) for x in inputs)
        last = held.get(name)
        if last is not None and _same(last[0], key):
            return last[1]
        value = compute()
        held[name] = (key, value)
        return value


#: the memo of kv_hf's decode steps (the layers' positions, next positions and new-token validity)
STEP = StepMemo()
