"""One attention layer of a compressed cache: a transformers ``CacheLayerMixin`` backed by a kvcore Store.

State machine:

``collect``
    Updates are kept raw in a *pending* buffer (attention over the whole prompt is exact) and the last
    ``query_window`` post-RoPE queries are remembered. A fresh layer starts here with ``auto_compress`` on: at the
    end of the first forward pass through the layer (right after its attention ran) the cache compresses it
    (:meth:`CompressedLayer.compress`: ``Compressor.compress`` into the layer's Store; a layer that already holds a
    compressed context appends the pending entries and re-plans them all with ``kvcore.retier_store``). So
    "prefill" means *the first forward pass through a fresh cache* (or the next one after
    ``cache.compress_next_prefill = True``); :func:`kv_hf.prefill` instead collects several chunks and compresses
    once at the end.
``store``
    Updates are appended to the Store (``Store.append``) with their true positions; attention sees the Store's
    ``read()`` view (plus the step's own raw tokens) with the view's per-entry logit bias, or — when the Store
    declares ``can_attend`` — through its fused ``attend`` merged with the step's own tokens. Every
    ``recompress_every`` committed tokens (or the compressor's own ``replan_every``) the cache re-plans the stored
    entries (``kvcore.retier_store``).
``scratch``
    Updates are attended to but not kept (KVzip's reconstruction pass); an observer sees the queries.

True positions: ``get_seq_length`` is the number of token slots seen (what transformers' ``generate`` and the
models use to derive ``position_ids``), never the number of entries held; ``get_mask_sizes`` returns the number of
keys attention really gets (stored view + pending + new), with ``kv_offset = seen - prefix`` so the last ``q``
columns of transformers' mask line up with the 2-D padding mask of the new tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kv_hf.entries import Pending
from kv_hf.options import CacheOptions
from kv_hf.providers import missing_message
from kv_hf.step import COLLECT, SCRATCH, STORE, Step, drop_handoff, hand_off
from kv_hf.step_memo import STEP
from kv_hf.support import DEFAULT_QUERY_WINDOW
from kvcore import Compressor, ScoringContext, Store, attends, retier_store, storage_bytes
from kvcore.checks import check_batch_index

__all__ = ["COLLECT", "SCRATCH", "STORE", "CompressedLayer", "Step"]


def _advance(nxt: torch.Tensor | None, positions: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``[B]`` next true position per row after a step's ``positions`` (padding, ``valid`` False, excluded)."""
    real = positions if valid is None else torch.where(valid, positions, -1)
    last = real.max(-1).values + 1
    return last if nxt is None else torch.maximum(nxt, last)


class CompressedLayer(CacheLayerMixin):
    """A cache layer whose entries live in a kvcore ``Store`` (one per layer, from ``compressor.new_store()``).

    The layer holds its Store, its pending prefill buffer, its captured queries and what it needs to compress
    them; it has no reference to the cache that orchestrates it (the cache decides when to compress and times it).

    Parameters
    ----------
    layer_idx : int
        Index of the attention layer.
    compressor : kvcore.Compressor
        Prefill compressor (scorer, selector, budget, protection); ``compressor.new_store()`` gives the Store.
    options : CacheOptions
        Re-compression targets and the re-compressor.
    query_window : int or None
        Trailing post-RoPE queries captured (``None``: every prompt query; ``0``: none).
    store : Store, optional
        The Store to use (default ``compressor.new_store()``).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        layer_idx: int,
        compressor: Compressor,
        options: CacheOptions | None = None,
        query_window: int | None = DEFAULT_QUERY_WINDOW,
        store: Store | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.compressor = compressor
        self.options = CacheOptions() if options is None else options
        self.recompressor = self.options.recompressor or compressor
        self.query_window = query_window
        self.store = compressor.new_store() if store is None else store
        self.fused = attends(self.store)  # decode through Store.attend (kvcore.AttendingStore); refuses a bad one
        self.observer: Callable[[CompressedLayer, torch.Tensor, torch.Tensor, float], None] | None = None
        # what the attention function calls after it committed a step of this layer (set by the cache: compress a
        # finished prefill, re-compress when due); carried by each Step
        self.on_commit: Callable[[CompressedLayer], None] | None = None
        self.recompressions = 0
        # queries committed after compression serve re-compression (and a later merged prefill) only: captured
        # when a scorer of the compressor or re-compressor declares ``needs_queries``
        self._capture_stored = query_window != 0 and (
            compressor.scorer.needs_queries or self.recompressor.scorer.needs_queries
        )
        self._clear()

    def _clear(self) -> None:
        self.seen = 0
        self.mode = COLLECT
        self.auto_compress = True
        self.pending: Pending | None = None
        self.queries: torch.Tensor | None = None  # last W committed queries [B, Hq, <=W, D]
        self._queries_end = 0  # the token slot after the last remembered query (queries[..., -1, :] is slot - 1)
        self.next_positions: torch.Tensor | None = None  # [B] next true position per row
        self._since = 0
        self._step: Step | None = None
        self._batch: int | None = None
        self._held: int | None = None  # the longest head's held entries (cached); None = unknown (read from the Store)

    def __repr__(self) -> str:
        store = type(self.store).__name__
        return f"CompressedLayer(layer_idx={self.layer_idx}, mode={self.mode}, seen={self.seen}, store={store})"

    # -- CacheLayerMixin ---------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Return ``[stored view | pending | new]`` keys/values; the attention function commits the new ones."""
        if self._step is not None:
            drop_handoff(self._step)
            self._step = None
            raise RuntimeError(
                f"layer {self.layer_idx}: the kv_hf attention function did not run for the previous update; "
                "the model's attention implementation must be 'kv_hf' or 'kv_hf_eager' (kv_hf.enable_attention)"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        B = key_states.shape[0]
        if self._batch is not None and self._batch != B:
            raise ValueError(
                f"layer {self.layer_idx}: batch size {B} does not match the cached batch size {self._batch}"
            )
        self._batch = B
        step = Step(self, key_states, value_states, on_commit=self.on_commit)
        self._step = step
        held = self.held()
        if held and self.fused:
            step.fused = True
            hand_off(key_states, step)
            return key_states, value_states
        if held and self.store.query_dependent:
            step.deferred = True
            hand_off(key_states, step)
            return key_states, value_states
        if held and self.plain_decode(key_states):
            step.appended = True  # no [view | new] concatenation: the attention function appends, then reads
            hand_off(key_states, step)
            return key_states, value_states
        keys, values = self.assemble(step, None)
        hand_off(keys, step)
        return keys, values

    def plain_decode(self, key_states: torch.Tensor) -> bool:
        """One token per row into the Store with nothing pending: it can be appended before attention runs."""
        return key_states.shape[2] == 1 and self.mode == STORE and (self.pending is None or not self.pending.length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        prefix = min(self._prefix_length(), self.seen)
        return prefix + query_length, self.seen - prefix

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the Store owns placement (tiers); transformers' offloading does not apply
        return None

    def prefetch(self) -> None:
        return None

    def reset(self) -> None:
        self.store.reset()
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop: remove the last ``-tokens_to_remove`` token slots (a negative int)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self.seen == 0:
            return
        self.truncate(max(self.seen + tokens_to_remove, 0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]`` (an integer tensor of batch rows)."""
        self._select_rows(beam_idx, "beam_idx")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._batch:
            self._select_rows(torch.arange(self._batch).repeat_interleave(repeats), "repeats")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not isinstance(indices, (torch.Tensor, list, tuple)):
            raise TypeError(f"indices must be an integer tensor or a list of ints, got {type(indices).__name__}")
        self._select_rows(torch.as_tensor(indices).flatten(), "indices")

    # -- attention hand-off ----------------------------------------------------------------------------
    def pending_part(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The pending raw entries as ``(keys, values, bias [B, Hkv, P])`` (``-inf`` on padding), or ``None``."""
        if self.pending is None or not self.pending.length:
            return None
        p = self.pending
        B, H = p.keys.shape[:2]
        pad = torch.zeros(p.valid.shape, dtype=torch.float32, device=p.keys.device).masked_fill(~p.valid, float("-inf"))
        return p.keys.to(dtype), p.values.to(dtype), pad[:, None, :].expand(B, H, -1)

    def assemble(self, step: Step, query: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Concatenate the stored view (read with ``query``), the pending raw entries and the step's new K/V."""
        ks, vs, bs = [], [], []
        dtype = step.keys.dtype
        bias_free = True  # known on the host to be all zero (no read of the bias needed)
        if self.held():
            view = self.store.read(query)
            ks.append(view.keys.to(dtype))
            vs.append(view.values.to(dtype))
            bs.append(view.logit_bias.float())
            bias_free = view.bias_free
        part = self.pending_part(dtype)
        if part is not None:
            ks.append(part[0])
            vs.append(part[1])
            bs.append(part[2])
            bias_free = False
        if not ks:
            step.n_prefix, step.bias = 0, None
            return step.keys, step.values
        bias = torch.cat(bs, -1) if len(bs) > 1 else bs[0]
        step.n_prefix = bias.shape[-1]
        step.bias = None if bias_free or not bool(bias.ne(0).any()) else bias
        return torch.cat(ks + [step.keys], 2), torch.cat(vs + [step.values], 2)

    def commit(
        self,
        step: Step,
        query: torch.Tensor,
        position_ids: torch.Tensor | None,
        valid: torch.Tensor | None,
        scaling: float,
    ) -> None:
        """Called by the attention function after attention ran: keep the step's tokens according to the mode."""
        self._step = None
        B, _, q, _ = step.keys.shape
        device = step.keys.device
        positions = self._positions(position_ids, B, q, device)
        if self.mode == SCRATCH:
            if self.observer is not None:
                self.observer(self, query, step.keys, scaling)
            return
        if self.mode == STORE and valid is not None and not bool(valid.all()):
            raise ValueError(
                f"layer {self.layer_idx}: padding inside a multi-token step after compression is not supported "
                "(it would be stored as real entries); left-pad only the first (prefill) call"
            )
        if self.mode == COLLECT or self._capture_stored:
            self._remember_queries(query, valid)
        given_valid = valid  # as given (None: no padding), before COLLECT spells it out
        if self.mode == COLLECT:
            if valid is None:
                valid = torch.ones(B, q, dtype=torch.bool, device=device)
            new = Pending(step.keys, step.values, positions, valid)
            self.pending = new if self.pending is None else self.pending.extend(*new.tensors())
        else:
            self.store.append(step.keys, step.values, positions)  # raises before anything below changes
            if self._held is not None:  # every head of every row gained the q tokens
                self._held += q
            self._since += q
        self.seen += q
        # every layer of a step advances the same tensors: the first computes, the others reuse its result
        prev = self.next_positions
        self.next_positions = STEP.get(
            "next", (positions, given_valid, prev), lambda: _advance(prev, positions, given_valid)
        )

    @property
    def replan_every(self) -> int | None:
        """Committed tokens between re-compressions: ``options.recompress_every``, else the compressor's own
        ``replan_every`` (a method that re-plans while decoding under its own budget, such as HqeKV's ``T``) unless
        ``options.replan`` is False."""
        if self.options.recompress_every:
            return self.options.recompress_every
        return self.recompressor.replan_every if self.options.replan else None

    @property
    def recompress_due(self) -> bool:
        """:attr:`replan_every` tokens were committed to the Store since the last (re-)compression."""
        every = self.replan_every
        return self.mode == STORE and bool(every) and self._since >= every

    def _positions(self, position_ids: torch.Tensor | None, B: int, q: int, device: torch.device) -> torch.Tensor:
        if position_ids is not None:
            if position_ids.ndim != 2:
                raise ValueError(f"kv_hf needs 2-D position_ids [B, q], got shape {tuple(position_ids.shape)}")
            return STEP.get(
                "positions",
                (position_ids, B, q, device),
                lambda: position_ids.to(device=device, dtype=torch.long).expand(B, q),
            )
        nxt, seen = self.next_positions, self.seen

        def count_on() -> torch.Tensor:
            start = nxt if nxt is not None else torch.full((B,), seen, device=device)
            return start.to(device)[:, None] + torch.arange(q, device=device)

        return STEP.get("count", (nxt, seen if nxt is None else None, B, q, device), count_on)

    def _remember_queries(self, query: torch.Tensor, valid: torch.Tensor) -> None:
        W = self.query_window
        if W == 0:
            return
        start = 0 if W is None else max(0, query.shape[2] - W)
        q = query[:, :, start:]
        if valid is not None:
            q = torch.where(valid[:, None, start:, None], q, torch.zeros((), dtype=q.dtype, device=q.device))
        if self.queries is not None and (W is None or q.shape[2] < W):
            held = self.queries if W is None else self.queries[:, :, max(0, self.queries.shape[2] + q.shape[2] - W) :]
            self.queries = torch.cat([held.to(q.dtype), q], 2).detach()  # a new tensor: one operation per step
        else:
            self.queries = q.detach().clone()
        self._queries_end = self.seen + query.shape[2]  # called before the step's tokens are counted in seen

    # -- compression -----------------------------------------------------------------------------------
    def held(self) -> bool:
        """Whether the Store holds at least one entry (cached between updates: the layer's own Store mutations
        -- compress, append, re-compress, truncate, reorder, reset -- keep it current; call
        :meth:`forget_held` after changing ``layer.store`` directly)."""
        return self.held_length() > 0

    def held_length(self) -> int:
        """Entries held by the longest head (cached like :meth:`held`: one host read after a change the layer
        cannot count, none per decode step)."""
        if self._held is None:
            lengths = self.store.seq_lengths()
            self._held = int(lengths.max()) if lengths.numel() else 0
        return self._held

    def forget_held(self) -> None:
        """Drop the cached :meth:`held` answer (the Store was changed from outside the layer)."""
        self._held = None

    def _prefix_length(self) -> int:
        n = self.pending.length if self.pending is not None else 0
        return n + self.held_length()

    def context(
        self, extras: Mapping[str, Any] | None = None, protect_before: int | None = None
    ) -> ScoringContext | None:
        """The pending entries as a ``ScoringContext`` (``None`` when nothing is pending); raises if the scorer
        lacks a declared input."""
        if self.pending is None or not self.pending.length:
            return None
        ctx = self.pending.context(
            queries=self.queries, layer_idx=self.layer_idx, extras=extras, protect_before=protect_before
        )
        missing = self.compressor.missing_inputs(ctx)
        if missing:
            raise ValueError(missing_message(self.compressor, missing, self.query_window))
        return ctx

    def compress(
        self,
        extras: Mapping[str, Any] | None = None,
        protect_before: int | None = None,
        compressor: Compressor | None = None,
    ) -> None:
        """Compress the pending entries into the Store.

        A fresh layer: ``Compressor.compress(ctx, store)`` (one write). A layer that already holds a compressed
        context: the pending entries are appended to the Store (``Store.append``) and everything it then holds is
        re-planned and re-tiered (``kvcore.retier_store``); held entries are never read back and written again.
        ``compressor`` overrides the layer's compressor for this call (chunked prefill: the same method with the
        token budget the whole prompt implies); its store is not used.
        """
        compressor = self.compressor if compressor is None else compressor
        if self.pending is not None and self.pending.length:
            if not self.held():
                ctx = self.context(extras, protect_before)
                compressor.compress(ctx, self.store)
            else:
                self._merge(extras, protect_before, compressor)
        self.stored()

    def _merge(self, extras: Mapping[str, Any] | None, protect_before: int | None, compressor: Compressor) -> None:
        p = self.pending
        if not bool(p.valid.all()):
            raise ValueError(
                f"layer {self.layer_idx}: a padded prefill cannot be merged into a layer that already holds a "
                "compressed context (the padding would be stored as real entries); left-pad only the first prefill"
            )
        missing = compressor.missing_inputs(
            p.context(queries=self.queries, layer_idx=self.layer_idx, extras=extras, protect_before=protect_before)
        )
        if missing:
            raise ValueError(missing_message(compressor, missing, self.query_window))
        self.store.append(p.keys, p.values, p.positions)
        retier_store(
            self.store,
            compressor,
            queries=self.queries,
            extras=extras,
            layer_idx=self.layer_idx,
            protect_before=protect_before,
        )

    def stored(self) -> None:
        """The pending entries are in the Store: switch to ``store`` mode."""
        self._held = None
        self.pending = None
        self.mode = STORE
        self.auto_compress = False
        self._since = 0
        if self.query_window is None and self.queries is not None:
            self.queries = self.queries[:, :, -DEFAULT_QUERY_WINDOW:].clone()  # every prompt query was for the prefill

    def recompress(self, target_length: int | None = None, target_ratio: float | None = None) -> None:
        """Re-score the stored entries and prune them to ``target_length`` per head (or keep ``1 - target_ratio``
        of the tokens seen by the longest row); defaults come from the cache options. With no target anywhere and a
        re-compressor that declares ``replan_every``, it re-plans under its own budget (HqeKV's re-tiering).

        Queries are the last ``query_window`` committed queries (the recent decode steps). The held entries are
        re-planned in place (``kvcore.replan`` then ``Store.retier``): kept entries are untouched, never
        re-quantized. Used for methods that re-plan while decoding (HqeKV re-tiering, decoding-stage HubKV, kvpress
        ``DecodingPress``).
        """
        opts = self.options
        if target_length is None and target_ratio is None:
            target_length, target_ratio = opts.target_length, opts.target_ratio
        own = target_length is None and target_ratio is None and self.recompressor.replan_every is not None
        if not own and (target_length is None) == (target_ratio is None):
            raise ValueError(
                "recompress needs exactly one of target_length or target_ratio (or a compressor that declares "
                "replan_every: it re-plans under its own budget)"
            )
        if self.pending is not None:
            raise ValueError(f"layer {self.layer_idx}: compress the pending prefill before re-compressing")
        self._since = 0
        if not self.held():
            return
        if own:
            compressor = self.recompressor  # its own budget and re-planner (kvcore.replan runs compressor.replanner)
        else:
            if target_length is None:
                seen = int(self.next_positions.max()) if self.next_positions is not None else self.seen
                target_length = max(1, math.floor(seen * (1.0 - target_ratio) + 1e-9))
            compressor = self.recompressor.with_budget(ratio=None, tokens=int(target_length))
        if compressor.scorer.needs_queries and self.queries is None:
            raise ValueError(missing_message(compressor, ["queries"], self.query_window))
        self._held = None
        retier_store(self.store, compressor, queries=self.queries, layer_idx=self.layer_idx)
        self.recompressions += 1

    # -- rollback / batch ------------------------------------------------------------------------------
    def row_offsets(self) -> torch.Tensor | None:
        """``[B]`` token slots minus true positions per row (left padding), or ``None`` before any token."""
        if self.next_positions is None:
            return None
        return self.seen - self.next_positions

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` token slots: every entry whose slot is ``>= length`` is dropped."""
        if length >= self.seen:
            return
        if length <= 0:
            self.reset()
            return
        offsets = self.row_offsets()
        if offsets is None or not bool((offsets == offsets[0]).all()):
            raise ValueError(
                "cannot roll back a batch whose rows have different left padding: rows would need different "
                "true-position cut-offs (roll back each row separately or use batch size 1)"
            )
        limit = length - int(offsets[0])
        if self.held():
            self._held = None
            self.store.crop(limit)
        if self.pending is not None:
            first_slot = self.seen - self.pending.length
            self.pending = self.pending.head(max(length - first_slot, 0)) if length > first_slot else None
        if self.queries is not None and length < self._queries_end:
            # the queries of the slots cut go too: a later compression must not score with queries of tokens that
            # are gone (a rolled-back question's queries would leak into the next question's compression)
            cut, kept = self._queries_end - length, self.queries.shape[2]
            self.queries = None if cut >= kept else self.queries[:, :, : kept - cut].clone()
            self._queries_end = length
        # the tokens committed since the last (re-)compression are the last _since slots: those cut are uncounted,
        # so a re-plan still comes every replan_every tokens the Store actually took (not tokens since rolled back)
        self._since = max(0, self._since - (self.seen - length))
        self.seen = length
        self.next_positions = torch.minimum(self.next_positions, torch.full_like(self.next_positions, limit))

    def _select_rows(self, index: object, name: str) -> None:
        """Keep batch rows ``index`` (validated first: an integer tensor of rows in ``[0, batch)``, never truncated
        from floats), in every part of the layer."""
        index = check_batch_index(name, index, self._batch)
        if self.held():
            self._held = None
            self.store.reorder(index)
        if self.pending is not None:
            self.pending = self.pending.select_rows(index)
        if self.queries is not None:
            self.queries = self.queries.index_select(0, index.to(self.queries.device))
        if self.next_positions is not None:
            self.next_positions = self.next_positions.index_select(0, index.to(self.next_positions.device))
        if self._batch is not None:
            self._batch = index.numel()

    # -- accounting ------------------------------------------------------------------------------------
    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes held by this layer: the Store's ``nbytes`` plus any pending raw prefill."""
        n = self.store.nbytes(device)
        if self.pending is not None:
            n += storage_bytes(self.pending.tensors(), device)
        return n

    def resident_nbytes(self) -> int:
        """Bytes of this layer in the fast tier: the Store's ``resident_nbytes`` plus any pending raw prefill."""
        n = self.store.resident_nbytes()
        if self.pending is not None:
            n += storage_bytes(self.pending.tensors())
        return n
