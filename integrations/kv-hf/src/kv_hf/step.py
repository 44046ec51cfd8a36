"""What a kv_hf cache layer hands its attention function: the layer modes, the per-update :class:`Step` and the
hand-off that carries it.

transformers calls ``cache.update(keys, values, layer_idx)`` and then the attention function with the keys the
update returned; it passes nothing else from the cache (neither the cache nor the layer reaches the attention
function). A cache layer (:mod:`kv_hf.layer`) therefore hands its :class:`Step` over explicitly with
:func:`hand_off` (the keys it returns and the step), and kv_hf's attention functions (:mod:`kv_hf.attention`) take it
with :func:`take_step`, given the key tensor they received: the step of the last update of this thread whose
returned keys are that tensor, or ``None`` (any other cache: the call is delegated unchanged). Nothing is set on the
tensor. The attention function builds the mask, attends to the Store and commits the step back to its layer
(``step.layer``). This module is what both sides share, so neither imports the other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

COLLECT = "collect"
"""Layer mode: updates kept raw in a pending buffer until the layer is compressed."""
STORE = "store"
"""Layer mode: updates appended to the layer's Store."""
SCRATCH = "scratch"
"""Layer mode: updates attended to but not kept (KVzip's reconstruction pass)."""


@dataclass
class Step:
    """What one ``update`` handed to attention: the new raw K/V and the bias of the columns before them."""

    layer: Any  # the kv_hf.layer.CompressedLayer that made the step (not imported: the layer imports this module)
    keys: torch.Tensor
    values: torch.Tensor
    n_prefix: int = 0
    bias: torch.Tensor | None = None  # [B, Hkv, n_prefix] float32 additive bias; None = all zero
    deferred: bool = False
    fused: bool = False  # attend to the Store with its fused ``attend`` and to [pending | new] separately
    appended: bool = False  # a single decode token: appended to the Store first, then attention over its read()
    on_commit: Callable[[Any], None] | None = None  # the layer's on_commit (set by the cache): run after the commit


class _Handoff(threading.local):
    """The step handed over by the last update of this thread, with the key tensor that update returned."""

    keys: torch.Tensor | None = None
    step: Step | None = None


_HANDOFF = _Handoff()


def hand_off(keys: torch.Tensor, step: Step) -> None:
    """Hand ``step`` to the attention function that will receive ``keys`` (what ``update`` returns).

    Parameters
    ----------
    keys : torch.Tensor
        The key tensor the layer's ``update`` returns: transformers passes this object to the attention function.
    step : Step
        The update's step; replaces a step handed over before and never taken (one update at a time per thread).
    """
    _HANDOFF.keys, _HANDOFF.step = keys, step


def take_step(keys: torch.Tensor) -> Step | None:
    """The step handed over with ``keys`` (:func:`hand_off`), once; ``None`` when ``keys`` is not the tensor the last
    kv_hf update of this thread returned (another cache's keys: attention runs unchanged).

    Parameters
    ----------
    keys : torch.Tensor
        The key tensor the attention function received.

    Returns
    -------
    Step or None
        The step, released from the hand-off (it holds no reference to ``keys`` or the step afterwards).
    """
    if _HANDOFF.step is None or _HANDOFF.keys is not keys:
        return None
    step = _HANDOFF.step
    _HANDOFF.keys, _HANDOFF.step = None, None
    return step


def drop_handoff(step: Step) -> None:
    """Release ``step`` from the hand-off if it is still there (a layer abandoning its step)."""
    if _HANDOFF.step is step:
        _HANDOFF.keys, _HANDOFF.step = None, None
