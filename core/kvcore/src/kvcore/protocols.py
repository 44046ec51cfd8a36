"""The four protocols of kvcore, and two optional capability protocols. All are runtime-checkable structural types.

Capabilities are declared once, as class attributes listed in the protocol (never probed with ``getattr``):
adapters read them to supply inputs (``Scorer.needs_queries`` ...) and to pick a path (``Store.can_attend`` ...).
Subclass a protocol to inherit the defaults (``class MyScorer(kvcore.Scorer): needs_queries = True``), or declare
every attribute yourself.

Two capabilities are protocols of their own, so that selectors and stores written before them still implement
``Selector`` and ``Store``: :class:`PlanBits` (a selector declares the tiers its plans may hold) and
:class:`TierPolicy` (a quantizing store lays a keep-or-evict plan out in its own tiers). :class:`kvcore.Compressor`
reads both to compose a keep-or-evict selector with a quantizing store (docs/protocols.md, "Composition").
Two more live in their own modules: :class:`kvcore.AttendingStore` (a store's fused ``attend``, declared by
``can_attend``; read through :func:`kvcore.attends`) and :class:`kvcore.TierShares` (a selector's ``tiers`` and
``resolve_shares(budget)``; read through :func:`kvcore.tier_shares`).
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

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
    query_window : int or None
        With ``needs_queries``: how many trailing post-RoPE queries it reads (SnapKV's observation window);
        ``None`` = every prompt query (H2O's accumulated attention).
    needs_values : bool
        ``score`` reads ``ctx.values``.
    needs_extras : frozenset of str
        Keys of ``ctx.extras`` it reads (``"surprisal"``, ``"hidden_states"``, ``"kvzip_scores"`` ...); adapters
        supply them through named providers or refuse.
    chunkable : bool
        Scores stay meaningful when the prompt is compressed chunk by chunk (chunked prefill with bounded memory):
        the held entries plus one new chunk are re-scored from what the cache holds, with the queries of the
        latest chunk only. True for key-only and position-only scorers; attention-window scorers may declare it as
        a documented approximation (SnapKV's window taken per chunk). Adapters refuse chunked compression for a
        scorer that does not declare it. Default ``False``.
    """

    needs_queries: ClassVar[bool] = False
    query_window: ClassVar[int | None] = None
    needs_values: ClassVar[bool] = False
    needs_extras: ClassVar[frozenset[str]] = frozenset()
    chunkable: ClassVar[bool] = False

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
class PlanBits(Protocol):
    """A selector that declares the tiers its plans may hold (optional capability of a :class:`Selector`).

    Attributes
    ----------
    plan_bits : frozenset of int
        Every tier a plan of ``select`` may use: ``EVICT = 0``, ``FULL = 16`` and quantized widths 1-8.
        ``frozenset({EVICT, FULL})`` declares a keep-or-evict selector (``TopKSelector``): it never quantizes, so
        :class:`kvcore.Compressor` lets a quantizing store lay its plans out (:class:`TierPolicy`) or refuses the
        pairing. A selector that does not declare it is not checked: its plans are written as they come.
    """

    plan_bits: frozenset[int]


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
    """Holds one layer's cache. Nothing is lost that the plan did not drop; ``nbytes`` is what is held.

    Every mutation (``write``, ``append``, ``retier``, ``crop``, ``reorder``) is all-or-nothing: a call that raises
    leaves ``read()`` and ``nbytes()`` as they were.

    Attributes
    ----------
    supported_bits : frozenset of int
        Tiers a plan may use (``0`` evict, ``16`` full precision, quantized widths).
    query_dependent : bool
        ``read(query)`` depends on the query (SEKV zoom-in); adapters must pass the current query.
    can_attend : bool
        The store has a fused ``attend(query, scale) -> (out, lse)`` equal to
        :func:`kvcore.attention.reference_attention` over ``read(query)`` (:class:`kvcore.AttendingStore`);
        adapters read it through :func:`kvcore.attends`, which refuses ``True`` without the method, and decode
        through ``attend``.
    can_demote : bool
        ``retier`` can move held entries down to a lower quantized width (from the held representation), besides
        evicting them.
    """

    supported_bits: ClassVar[frozenset[int]]
    query_dependent: ClassVar[bool] = False
    can_attend: ClassVar[bool] = False
    can_demote: ClassVar[bool] = False

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

    def tiers(self) -> Plan:
        """The tier of every held entry, laid out like ``read()`` (``[B, Hkv, T]``; padding is ``EVICT``)."""
        ...

    def retier(self, plan: Plan) -> None:
        """Apply a new plan to the held entries, laid out like ``read()`` / ``tiers()``.

        Each entry's new tier is ``EVICT``, its held tier (the entry is not touched: bytes identical), or — with
        ``can_demote`` — a lower supported width, transcoded from the held representation (never a
        dequantize-everything-and-requantize pass). Moving up, or a width the store does not hold, is a
        ``ValueError``; padding must be ``EVICT``. Evicted entries free their memory.
        """
        ...

    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes held (on ``device``, or on all devices)."""
        ...

    def resident_nbytes(self) -> int:
        """Bytes held in the fast tier: what a compression budget is charged for.

        A store that offloads part of what it holds to slower memory on purpose (SEKV's span bases in host memory,
        fetched on demand) leaves that part out; every other store holds everything in the fast tier, which is
        this default. Always ``0 <= resident_nbytes() <= nbytes()``, whatever device the store runs on (on a
        CPU-only run the "fast tier" is the memory the model computes from)."""
        return self.nbytes()

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


@runtime_checkable
class TierPolicy(Protocol):
    """A quantizing store's own tier layout (optional capability of a :class:`Store`).

    A store that quantizes only the entries a plan tiers at its widths holds a full-precision cache when the plan
    comes from a keep-or-evict selector. A store implementing this protocol says how it would tier what such a plan
    keeps (KIVI's prefill layout: quantized prefix, full-precision residual), and :class:`kvcore.Compressor` applies
    it before ``write`` whenever its selector declares ``plan_bits == {EVICT, FULL}`` (:class:`PlanBits`).
    """

    def apply_tiers(self, plan: Plan) -> Plan:
        """``plan`` (laid out like ``write``'s ``[B, Hkv, T]``) with the entries it keeps tiered by the store's own
        policy; evicted entries stay ``EVICT`` and the kept set is unchanged."""
        ...
