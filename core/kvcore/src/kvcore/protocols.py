"""The four protocols of kvcore (DESIGN.md §3). All are runtime-checkable structural types."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from kvcore.budget import Budget
from kvcore.context import ScoringContext
from kvcore.plan import Plan
from kvcore.quantized import QuantizedTensor
from kvcore.scores import Scores
from kvcore.view import KVView


@runtime_checkable
class Scorer(Protocol):
    """Importance of every cache entry: a deterministic, pure function of its context.

    Attributes
    ----------
    needs_queries : bool
        ``score`` reads ``ctx.queries``; adapters must supply a query window or refuse.
    needs_values : bool
        ``score`` reads ``ctx.values``.
    needs_extras : frozenset of str
        Keys of ``ctx.extras`` it reads (``"surprisal"``, ``"hidden_states"``, ``"kvzip_queries"`` ...).
    """

    needs_queries: bool
    needs_values: bool
    needs_extras: frozenset[str]

    def score(self, ctx: ScoringContext) -> Scores:
        """Return float32 finite scores ``[B, Hkv, T]``, higher = keep."""
        ...


@runtime_checkable
class Selector(Protocol):
    """Turns scores and a budget into a plan. ``ratio`` is the fraction removed; protected tokens are kept
    and count inside the budget; ties break by lower index; padding is never kept."""

    def select(
        self,
        scores: Scores,
        budget: Budget,
        protected: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> Plan:
        """``protected`` and ``valid`` are ``[B, T]`` (or ``[B, Hkv, T]``) bool masks."""
        ...


@runtime_checkable
class Quantizer(Protocol):
    """Quantizes ``[..., T, D]`` tensors with explicit grouping (``axis``, ``group_size``) at ``bits``."""

    bits: int
    axis: str
    group_size: int

    def quantize(self, x: torch.Tensor) -> QuantizedTensor: ...

    def dequantize(self, q: QuantizedTensor) -> torch.Tensor: ...


@runtime_checkable
class Store(Protocol):
    """Holds one layer's cache. Nothing is lost that the plan did not drop; ``nbytes`` is what is held."""

    supported_bits: frozenset[int]

    def write(self, keys: torch.Tensor, values: torch.Tensor, plan: Plan, positions: torch.Tensor) -> None:
        """Replace the content with ``keys``/``values`` ``[B, Hkv, T, D]`` laid out per ``plan``;
        ``positions`` ``[B, T]`` are the true token positions."""
        ...

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Add ``[B, Hkv, n, D]`` new entries (full precision, or the store's own residual policy)."""
        ...

    def read(self, query: torch.Tensor | None = None) -> KVView:
        """Attention-ready view; ``query`` ``[B, Hq, Q, D]`` is for query-dependent stores."""
        ...

    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes held (on ``device``, or on all devices)."""
        ...

    def seq_lengths(self) -> torch.Tensor:
        """``[B, Hkv]`` number of entries held per head."""
        ...

    def crop(self, position: int) -> None:
        """Drop every entry whose true position is ``>= position`` (roll back appended tokens)."""
        ...

    def reorder(self, index: torch.Tensor) -> None:
        """Reorder / select batch rows (beam search): row ``i`` becomes old row ``index[i]``."""
        ...

    def reset(self) -> None:
        """Drop everything and free the memory."""
        ...
