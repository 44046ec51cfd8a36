"""What a kv_hf cache layer hands its attention function: the layer modes and the per-update :class:`Step`.

A cache layer (:mod:`kv_hf.layer`) tags the key tensor it returns from ``update`` with a :class:`Step` under the
attribute :data:`STEP_ATTR`; kv_hf's attention functions (:mod:`kv_hf.attention`) read it to build the mask, attend
to the Store and commit the step back to the layer. This module is what both sides share, so neither imports the
other.
"""

from __future__ import annotations

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

STEP_ATTR = "_kv_hf_step"
"""Attribute set on the key tensor a kv_hf cache layer returns; carries the :class:`Step`."""


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
    on_commit: Callable[[Any], None] | None = None  # set by the cache: what to do after the commit
