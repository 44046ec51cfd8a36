"""A transformers ``Cache`` whose layers are kvcore Stores, and the entry point :func:`compressed_cache`."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache

from kv_hf.attention import enable_attention
from kv_hf.implementations import KV_HF_IMPLEMENTATIONS
from kv_hf.layer import CompressedLayer
from kv_hf.options import CacheOptions
from kv_hf.step import COLLECT, SCRATCH, STORE
from kv_hf.support import check_compressor, check_model, layer_kinds, resolve_query_window
from kv_hf.window import WindowLayer
from kvcore import Compressor
from kvcore.checks import check_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class CompressedCache(Cache):
    """A layered transformers cache (``Cache(layers=[...])``) with one :class:`CompressedLayer` per global-attention
    layer and, in a hybrid model, one :class:`~kv_hf.window.WindowLayer` per sliding-window layer (kept as
    transformers keeps it: the window is already bounded).

    Use it as ``model(ids, past_key_values=cache)`` or ``model.generate(ids, past_key_values=cache)``. The first
    forward pass through the cache is the prefill: each layer attends to the whole uncompressed prompt, then scores,
    selects and writes it to its Store (``compressor.new_store()``); later tokens are appended to the Stores.
    Build it with :func:`compressed_cache`.

    Parameters
    ----------
    model : PreTrainedModel
        A supported causal LM (:data:`kv_hf.support.SUPPORTED_MODEL_TYPES`); switched to the kv_hf attention.
    compressor : kvcore.Compressor
        Scorer -> selector -> store; ``compressor.budget`` is the prefill budget.
    options : CacheOptions
        Query capture and decode-time re-compression.

    Attributes
    ----------
    query_window : int or None
        Trailing post-RoPE queries captured per layer (``None``: every prompt query); see
        :func:`kv_hf.support.resolve_query_window`.
    replan_paused : bool
        While True, periodic re-compression (``recompress_every`` or the compressor's own ``replan_every``) waits;
        :func:`kv_hf.generate_answer` pauses it while an answer that will be rolled back is decoded (the context
        must come back exactly).
    compressed : list of CompressedLayer
        The compressed (global-attention) layers, in layer order; ``layers`` holds every layer.
    windows : list of WindowLayer
        The sliding-window layers (empty for a model with global attention only).
    compress_seconds : float
        Wall time spent compressing so far (scoring, selection, Store writes, re-compressions and KVzip's
        reconstruction pass), separate from the model's own forward passes.
    """

    def __init__(self, model: PreTrainedModel, compressor: Compressor, options: CacheOptions | None = None) -> None:
        options = CacheOptions() if options is None else options
        if not isinstance(options, CacheOptions):
            raise TypeError(f"options must be a kv_hf.CacheOptions, got {type(options).__name__}")
        config = check_model(model)
        self.compressor = check_compressor(compressor, options)
        self.options = options
        self.query_window = resolve_query_window(self.compressor, options)
        self.recompressor = options.recompressor or compressor
        enable_attention(model)
        self._config = config
        self.compress_seconds = 0.0
        self.replan_paused = False
        self._timing = 0
        layers = [
            CompressedLayer(i, self.compressor, options, self.query_window)
            if kind == "compressed"
            else WindowLayer(i, config.sliding_window)
            for i, kind in enumerate(layer_kinds(config))
        ]
        super().__init__(layers=layers)
        self.compressed: list[CompressedLayer] = [layer for layer in layers if isinstance(layer, CompressedLayer)]
        for layer in self.compressed:
            layer.on_commit = self._committed  # each step of the layer carries it to the attention function
        self.windows: list[WindowLayer] = [layer for layer in layers if isinstance(layer, WindowLayer)]

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Add the wall time of the enclosed compression work (scoring, selection, store writes, KVzip's
        reconstruction pass) to :attr:`compress_seconds`; CUDA work is synchronised; nested blocks count once."""
        self._timing += 1
        outer = self._timing == 1
        if outer:
            _sync()
            t0 = time.perf_counter()
        try:
            yield
        finally:
            self._timing -= 1
            if outer:
                _sync()
                self.compress_seconds += time.perf_counter() - t0

    # -- transformers hooks ------------------------------------------------------------------------------
    def check_attention(self) -> None:
        """Raise if the model was switched away from the kv_hf attention (the per-head bias would be lost)."""
        impl = self._config._attn_implementation
        if impl not in KV_HF_IMPLEMENTATIONS:
            raise RuntimeError(
                f"the model's attention implementation is {impl!r}; a kv_hf cache needs 'kv_hf' or 'kv_hf_eager' "
                "(call kv_hf.enable_attention(model))"
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """transformers' hook: the layer returns what attention sees and hands its step to the kv_hf attention
        function (:func:`kv_hf.step.hand_off`); the step calls back :meth:`_committed` (the layer's ``on_commit``)
        once the new tokens are kept."""
        self.check_attention()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _committed(self, layer: CompressedLayer) -> None:
        """A layer kept its step: compress a finished prefill (per layer now; a global budget once the last layer
        is done) or re-compress when ``recompress_every`` tokens were added."""
        if layer.mode == COLLECT and layer.auto_compress:
            if self.compressor.budget.granularity != "global":
                with self.timed():
                    layer.compress()
            elif layer is self.compressed[-1]:
                self.compress()
        elif layer.recompress_due and not self.replan_paused:
            with self.timed():
                layer.recompress()

    # -- public API ----------------------------------------------------------------------------------------
    def nbytes(self, device: torch.device | str | None = None) -> int:
        """Bytes actually held by every layer: the Stores' ``nbytes`` (plus any not-yet-compressed prefill) and the
        sliding-window layers' windows."""
        return sum(layer.nbytes(device) for layer in self.layers)

    def resident_nbytes(self) -> int:
        """Bytes in the fast tier (``Store.resident_nbytes``): ``nbytes()`` less what a store offloads on purpose
        (SEKV's span bases in host memory)."""
        return sum(layer.resident_nbytes() for layer in self.layers)

    def seq_lengths(self) -> list[torch.Tensor]:
        """Per compressed layer, the ``[B, Hkv]`` number of entries held by the Store."""
        return [layer.store.seq_lengths() for layer in self.compressed]

    def next_positions(self) -> torch.Tensor | None:
        """``[B]`` true position of the next token of every row (``None`` before the first token)."""
        return self.compressed[0].next_positions

    @property
    def compress_next_prefill(self) -> bool:
        """Whether the next forward pass is collected raw and compressed (with what is stored) at its end."""
        return all(layer.mode == COLLECT and layer.auto_compress for layer in self.compressed)

    @compress_next_prefill.setter
    def compress_next_prefill(self, value: bool) -> None:
        for layer in self.compressed:
            if value:
                layer.mode, layer.auto_compress = COLLECT, True
            elif layer.mode == COLLECT and layer.pending is None:
                layer.mode, layer.auto_compress = STORE, False

    def collect(self) -> None:
        """Keep the following forward passes raw (chunked prefill) until :meth:`compress` is called."""
        for layer in self.compressed:
            layer.mode, layer.auto_compress = COLLECT, False

    def compress(
        self,
        extras: Mapping[int, Mapping[str, Any]] | Mapping[str, Any] | None = None,
        protect_before: int | None = None,
        compressor: Compressor | None = None,
    ) -> None:
        """Compress every layer's collected (pending) entries now.

        Parameters
        ----------
        extras : mapping, optional
            ``ScoringContext.extras``: one mapping for all layers, or ``{layer_idx: mapping}``.
        protect_before : int, optional
            Entries whose true position is below this are always kept (a system prompt; KVzip's sink).
        compressor : kvcore.Compressor, optional
            Overrides the cache's compressor for this call (chunked prefill compresses each chunk step with the
            token budget the whole prompt implies); its store is not used, and its budget may not be "global".
        """
        per_layer = self._per_layer(extras)
        if compressor is not None and not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a kvcore.Compressor, got {type(compressor).__name__}")
        with self.timed():
            if compressor is None and self.compressor.budget.granularity == "global":
                self._compress_global(per_layer, protect_before)
                return
            if compressor is not None and compressor.budget.granularity == "global":
                raise ValueError("compress(compressor=...) takes a 'head' or 'layer' budget, not 'global'")
            for layer in self.compressed:
                layer.compress(extras=per_layer(layer.layer_idx), protect_before=protect_before, compressor=compressor)

    def recompress(self, target_length: int | None = None, target_ratio: float | None = None) -> None:
        """Re-score and prune every layer now (see :meth:`CompressedLayer.recompress`)."""
        with self.timed():
            for layer in self.compressed:
                layer.recompress(target_length, target_ratio)

    def rollback(self, length: int) -> None:
        """Forget every token slot from ``length`` on (``get_seq_length()`` becomes ``length``): the
        multi-question protocol's crop back to the context. Entries evicted by a re-compression stay gone. The
        forgotten tokens also leave the re-plan period (``replan_every`` / ``recompress_every`` count the tokens the
        Store still holds since its last compression) and the remembered query window (a later compression never
        scores with the queries of forgotten tokens)."""
        check_int("length", length, low=0)
        for layer in self.layers:
            layer.truncate(length)

    @contextlib.contextmanager
    def scratch(
        self, observer: Callable[[CompressedLayer, torch.Tensor, torch.Tensor, float], None] | None = None
    ) -> Iterator[CompressedCache]:
        """Forward passes inside this context attend to the cache but leave nothing in it; ``observer(layer, query,
        new_keys, scaling)`` sees every layer's step (KVzip's context reconstruction)."""
        saved = [(layer.mode, layer.observer) for layer in self.compressed]
        for layer in self.compressed:
            layer.mode, layer.observer = SCRATCH, observer
        for window in self.windows:
            window.mode = SCRATCH
        try:
            yield self
        finally:
            for layer, (mode, obs) in zip(self.compressed, saved):
                layer.mode, layer.observer = mode, obs
                layer._step = None
            for window in self.windows:
                window.mode = STORE

    @contextlib.contextmanager
    def held(self) -> Iterator[CompressedCache]:
        """Inside this context the sliding-window layers keep what slides out of their windows, so that
        :meth:`rollback` can return to the length at entry (the multi-question protocol)."""
        for window in self.windows:
            window.hold()
        try:
            yield self
        finally:
            for window in self.windows:
                window.release()

    # -- helpers -------------------------------------------------------------------------------------------
    def _per_layer(self, extras) -> Callable[[int], Mapping[str, Any] | None]:
        if not extras:
            return lambda i: None
        if all(isinstance(k, int) for k in extras):
            return lambda i: extras.get(i)
        return lambda i: extras

    def _compress_global(self, per_layer, protect_before: int | None) -> None:
        """One selection over every layer (``Compressor.compress_layers``), written into the layers' own Stores."""
        layers = [layer for layer in self.compressed if layer.pending is not None and layer.pending.length]
        if not layers:
            for layer in self.compressed:
                layer.stored()
            return
        if len(layers) != len(self.compressed) or any(layer.held() for layer in self.compressed):
            raise ValueError(
                "a 'global' budget selects over all layers at once: every layer must hold only its collected "
                "prefill (no stored entries) when it is compressed"
            )
        ctxs = [layer.context(per_layer(layer.layer_idx), protect_before) for layer in layers]
        lengths = {c.seq_len for c in ctxs}
        if len(lengths) != 1:
            raise ValueError(
                f"a 'global' budget needs the same number of collected tokens in every layer, got {sorted(lengths)}"
            )
        self.compressor.compress_layers(ctxs, stores=[layer.store for layer in layers])
        for layer in layers:
            layer.stored()


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def compressed_cache(model: PreTrainedModel, compressor: Compressor, **options: Any) -> CompressedCache:
    """A transformers ``Cache`` that compresses ``model``'s KV cache with ``compressor``.

    ``model.generate(ids, past_key_values=compressed_cache(model, compressor))`` prefills the prompt exactly, then
    keeps only what ``compressor`` selects (real bytes freed: ``cache.nbytes()``) and decodes over it with the
    true token positions. The model is switched to the kv_hf attention function (:func:`kv_hf.enable_attention`),
    which behaves exactly like SDPA/eager for any other cache.

    Parameters
    ----------
    model : PreTrainedModel
        Llama, Mistral (full attention), Qwen2, Qwen3 or Gemma 3 family causal LM with ``sdpa`` or ``eager``
        attention. In a hybrid model (Gemma 3: five sliding-window layers per global one) the global layers are
        compressed and the sliding-window layers keep their window as transformers does; the budget's ratio applies
        to the global layers' tokens and ``nbytes()`` counts every layer.
    compressor : kvcore.Compressor
        Any kvcompress method (``Compressor(scorer=, selector=, store=, budget=)``).
    **options
        Fields of :class:`CacheOptions`: ``query_window``, ``recompress_every``, ``target_length``,
        ``target_ratio``, ``recompressor``, ``replan``.

    Returns
    -------
    CompressedCache
    """
    names = {f.name for f in dataclasses.fields(CacheOptions)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise TypeError(f"unknown compressed_cache options {unknown}; allowed: {sorted(names)}")
    return CompressedCache(model, compressor, CacheOptions(**options))
