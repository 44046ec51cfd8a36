"""One exact prefill, many compressions: collect a prompt raw once, then compress copies of it with any number of
compressors, each giving the cache :func:`kv_hf.prefill` would have built for it.

One-shot compression never changes the prefill's own forward pass -- every layer attends to the whole prompt
uncompressed and is compressed only afterwards (kvpress and KVzip do the same) -- so the raw keys, values and
queries of a prompt are the same whatever method compresses them. An evaluation grid (methods x budgets on the
same samples) therefore needs one forward pass per sample, not one per cell: :func:`collect_prefill` runs it and
keeps every layer's raw entries and every prompt query, :meth:`CollectedPrefill.compress` builds a fresh
:class:`~kv_hf.cache.CompressedCache` for a compressor, hands it a private copy of that state (trimmed to the
query window the compressor's cache would capture), supplies the extras its scorer needs and compresses. A
provider's extras depend only on the model, the prompt and the provider's configuration (it runs on the raw
collected prompt), so each provider pass (KVzip's context reconstruction) runs once per prompt and configuration
and is reused by every compressor that needs it; its time is still added to each cache's ``compress_seconds``, as
if it had run again.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kv_hf import providers
from kv_hf.cache import CompressedCache
from kv_hf.entries import Pending
from kv_hf.options import CacheOptions
from kv_hf.prefill import _check_chunking, _check_ids
from kvcore import Budget, Compressor, DenseStore, Scorer, TopKSelector

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _EveryQuery(Scorer):
    """The collecting cache's scorer: asks for every prompt query (so all are captured) and never scores."""

    needs_queries = True
    query_window = None

    def score(self, ctx):  # pragma: no cover - the collecting cache never compresses
        raise RuntimeError("a collected prefill is compressed through CollectedPrefill.compress")


@dataclass
class _LayerState:
    pending: Pending
    queries: torch.Tensor | None
    seen: int
    next_positions: torch.Tensor
    dtype: torch.dtype
    device: torch.device
    batch: int


@dataclass
class _WindowState:
    keys: torch.Tensor
    values: torch.Tensor
    seen: int


@dataclass
class CollectedPrefill:
    """A prompt prefilled once, exactly and uncompressed, ready to be compressed by several compressors.

    Built by :func:`collect_prefill`; nothing in it is changed by :meth:`compress`.

    Attributes
    ----------
    logits : Tensor
        ``[B, vocab]`` logits of the last prompt position (what :func:`kv_hf.prefill` returns).
    forward_seconds : float
        Wall time of the shared forward pass.
    """

    model: Any
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    logits: torch.Tensor
    forward_seconds: float
    tokenizer: Any = None
    context_start: int = 0
    _layers: list[_LayerState] = field(default_factory=list, repr=False)
    _windows: list[_WindowState] = field(default_factory=list, repr=False)
    _captured: dict[str, Any] = field(default_factory=dict, repr=False)
    _provided: dict[tuple[str, str], tuple[dict, float]] = field(default_factory=dict, repr=False)

    def compress(
        self, compressor: Compressor, options: CacheOptions | None = None, **provider_options: Any
    ) -> CompressedCache:
        """A new cache holding this prompt compressed by ``compressor`` -- the cache
        ``kv_hf.prefill(model, compressed_cache(model, compressor, ...), input_ids, ...)`` would build.

        Parameters
        ----------
        compressor : kvcore.Compressor
            Any compressor the adapter supports (one-shot compression; a ``"global"`` budget too).
        options : CacheOptions, optional
            The new cache's options (query window, decode-time re-compression).
        **provider_options
            Provider configuration, as for :func:`kv_hf.prefill` (``kvzip=``, ``surprisal=``).

        Returns
        -------
        CompressedCache
            Compressed; its ``compress_seconds`` counts this compression (and any provider pass) only.
        """
        unknown = sorted(set(provider_options) - providers.options())
        if unknown:
            raise TypeError(f"unknown prefill options {unknown}; provider options: {sorted(providers.options())}")
        cache = CompressedCache(self.model, compressor, CacheOptions() if options is None else options)
        needed = providers.providers_for(cache.compressor.scorer.needs_extras)
        for provider in needed:  # on the fresh cache, as kv_hf.prefill checks them
            provider.check(cache, self.input_ids, self.attention_mask, self.tokenizer)
        cache.collect()
        for window, state in zip(cache.windows, self._windows):
            window.lazy_initialization(state.keys, state.values)
            window.keys, window.values = state.keys.clone(), state.values.clone()
            window.cumulative_length = state.seen
        for layer, state in zip(cache.compressed, self._layers):
            layer.is_initialized = True
            layer.dtype, layer.device = state.dtype, state.device
            layer._batch = state.batch
            layer.seen = state.seen
            layer.next_positions = state.next_positions.clone()
            # private copies: a Store may keep (and later write into) the tensors it is given
            layer.pending = Pending(*(t.clone() for t in state.pending.tensors()))
            layer.queries = _window(state.queries, cache.query_window)
        B, T = self.input_ids.shape
        mask = (
            torch.ones(B, T, dtype=torch.long, device=self.input_ids.device)
            if self.attention_mask is None
            else self.attention_mask.to(self.input_ids.device).long()
        )
        extras: dict[int, dict[str, Any]] | None = {} if needed else None
        for provider in needed:
            found = self._provided.get((provider.name, repr(provider_options.get(provider.option))))
            if found is None:
                t0 = cache.compress_seconds
                with cache.timed():
                    result = providers.run_providers(
                        [provider],
                        self.model,
                        cache,
                        self.input_ids,
                        tokenizer=self.tokenizer,
                        context_start=self.context_start,
                        configs=provider_options,
                        captured=self._captured,
                        attention_mask=mask,
                    )
                found = (result, cache.compress_seconds - t0)
                self._provided[(provider.name, repr(provider_options.get(provider.option)))] = found
            else:  # the same pass over the same prompt: reused, its time counted as if it had run again
                cache.compress_seconds += found[1]
            for layer_idx, named in found[0].items():
                mine = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in named.items()}
                extras.setdefault(layer_idx, {}).update(mine)
        cache.compress(extras=extras, protect_before=self.context_start or None)
        return cache


def _window(queries: torch.Tensor | None, window: int | None) -> torch.Tensor | None:
    """The trailing ``window`` queries a cache with that query window would have captured (``None``: all)."""
    if queries is None or window == 0:
        return None
    return queries.clone() if window is None else queries[:, :, -window:].clone()


@torch.no_grad()
def collect_prefill(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    context_start: int = 0,
    chunk_size: int | None = None,
) -> CollectedPrefill:
    """Prefill ``input_ids`` once, exactly, keeping every layer's raw K/V and every prompt query.

    Compress the result with :meth:`CollectedPrefill.compress`, once per compressor: an evaluation of several
    methods on the same prompt then costs one forward pass instead of one per method. Activations that providers
    capture during the prefill (the surprisal provider's hidden states) are captured here for all of them.

    Parameters
    ----------
    model : PreTrainedModel
        A model :func:`kv_hf.compressed_cache` supports.
    input_ids : Tensor
        ``[B, T]`` token ids (left-padded when ``B > 1``).
    attention_mask : Tensor, optional
        ``[B, T]`` 1 for real tokens, 0 for (left) padding.
    tokenizer : optional
        For providers that build prompts (KVzip's reconstruction pass).
    context_start : int
        True position of the first context token (earlier tokens are always kept), as in :func:`kv_hf.prefill`.
    chunk_size : int, optional
        Forward the prompt in chunks of this many tokens (peak activation memory); the result is the same.

    Returns
    -------
    CollectedPrefill
    """
    _check_ids(input_ids, attention_mask)
    _check_chunking(input_ids, chunk_size, context_start)
    carrier = Compressor(scorer=_EveryQuery(), selector=TopKSelector(), store=DenseStore, budget=Budget(ratio=0.0))
    cache = CompressedCache(model, carrier)
    B, T = input_ids.shape
    device = input_ids.device
    mask = (
        torch.ones(B, T, dtype=torch.long, device=device)
        if attention_mask is None
        else attention_mask.to(device).long()
    )
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache.collect()
    step = T if chunk_size is None else chunk_size
    capturing = [p for p in providers.PROVIDERS.values() if p.capture is not None]
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        captured = {p.name: stack.enter_context(p.capture(model)) for p in capturing}
        for a in range(0, T, step):
            b = min(a + step, T)
            out = model(
                input_ids=input_ids[:, a:b],
                attention_mask=mask[:, :b],
                position_ids=positions[:, a:b],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    layers = [
        _LayerState(
            pending=layer.pending,
            queries=layer.queries,
            seen=layer.seen,
            next_positions=layer.next_positions,
            dtype=layer.dtype,
            device=layer.device,
            batch=layer._batch,
        )
        for layer in cache.compressed
    ]
    windows = [_WindowState(w.keys, w.values, w.cumulative_length) for w in cache.windows]
    return CollectedPrefill(
        model=model,
        input_ids=input_ids,
        attention_mask=attention_mask,
        logits=out.logits[:, -1],
        forward_seconds=elapsed,
        tokenizer=tokenizer,
        context_start=context_start,
        _layers=layers,
        _windows=windows,
        _captured=captured,
    )


__all__ = ["CollectedPrefill", "collect_prefill"]
