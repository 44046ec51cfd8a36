"""Explicit prefill: collect a prompt (optionally in chunks), supply the scorer's extras through the named
providers (:mod:`kv_hf.providers`), compress once -- or, with ``compress_chunks=True``, compress after every chunk
so the cache never holds more than the budget plus one chunk (bounded prefill memory)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from kv_hf import providers
from kv_hf.cache import CompressedCache
from kvcore import Compressor
from kvcore.checks import check_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _check_ids(input_ids: object, attention_mask: object) -> None:
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.ndim != 2
        or input_ids.dtype not in (torch.int32, torch.int64)
    ):
        raise ValueError("input_ids must be an integer tensor [B, T]")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids must hold at least one token")
    if attention_mask is not None and (
        not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(input_ids.shape)
    ):
        raise ValueError(f"attention_mask must be a tensor of shape {tuple(input_ids.shape)} (the new tokens only)")


def _check_chunking(input_ids: torch.Tensor, chunk_size: object, context_start: object) -> None:
    check_int("chunk_size", chunk_size, low=1, optional="one pass")
    check_int("context_start", context_start, low=0, high=input_ids.shape[1] - 1)


@torch.no_grad()
def prefill(
    model: PreTrainedModel,
    cache: CompressedCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    tokenizer: Any = None,
    context_start: int = 0,
    chunk_size: int | None = None,
    compress_chunks: bool = False,
    **provider_options: Any,
) -> torch.Tensor:
    """Prefill ``input_ids`` into ``cache`` exactly, then compress them once; returns the last position's logits.

    The tokens are attended to uncompressed (in ``chunk_size`` chunks if given, each chunk seeing all earlier ones
    raw), the last ``query_window`` queries are captured, and the providers of the extras the compressor's scorer
    declares in ``needs_extras`` run (:data:`kv_hf.providers.PROVIDERS` lists them; a name no provider supplies is a
    ``ValueError``). Then every layer is scored, selected and written to its Store (merged with what it
    already held).

    Parameters
    ----------
    model : PreTrainedModel
        The model the cache was built for.
    cache : CompressedCache
        From :func:`kv_hf.compressed_cache`; may already hold a compressed context (the new tokens are merged in).
    input_ids : Tensor
        ``[B, T]`` token ids (left-padded when ``B > 1``).
    attention_mask : Tensor, optional
        ``[B, T]`` 1 for real tokens, 0 for (left) padding; padding is never kept.
    tokenizer : optional
        For providers that build prompts: an object with ``encode(text, add_special_tokens=False)``.
    context_start : int
        True position of the first context token: earlier tokens (a system prompt) are always kept; providers
        treat them as the prefix (an attention sink) and ``input_ids[:, context_start:]`` as the context.
    chunk_size : int, optional
        Prefill chunk length (peak activation memory); the collected K/V are held raw until the end unless
        ``compress_chunks``.
    compress_chunks : bool
        Compress after every chunk (needs ``chunk_size``): each chunk attends to the compressed cache plus itself,
        then the held entries and the chunk are re-scored and cut to the token count the budget implies for the
        whole prompt (a ratio budget keeps ``budget.kept(T)`` per head at every step, never fewer), so the held
        KV is at most that count plus one chunk instead of the whole prompt; true positions are kept. The
        scorer must declare ``chunkable = True`` (key-only and position-only scorers give what one-shot
        compression gives; SnapKV/H2O score with the latest chunk's queries, an approximation). Needs an empty
        cache, unpadded rows, no provider extras and a "head" or "layer" budget.
    **provider_options
        Configuration of a provider, by the keyword its :class:`~kv_hf.providers.Provider` declares (``option``);
        see :func:`kv_hf.providers.options`.

    Returns
    -------
    Tensor
        ``[B, vocab]`` logits of the last position (the first answer token for greedy decoding).
    """
    if not isinstance(cache, CompressedCache):
        raise TypeError(f"cache must be a kv_hf.CompressedCache, got {type(cache).__name__}")
    _check_ids(input_ids, attention_mask)
    _check_chunking(input_ids, chunk_size, context_start)
    if not isinstance(compress_chunks, bool):
        raise TypeError(f"compress_chunks must be a bool, got {type(compress_chunks).__name__}")
    unknown = sorted(set(provider_options) - providers.options())
    if unknown:
        raise TypeError(f"unknown prefill options {unknown}; provider options: {sorted(providers.options())}")
    if compress_chunks:
        return _prefill_chunked(model, cache, input_ids, attention_mask, chunk_size, context_start)
    needed = providers.providers_for(cache.compressor.scorer.needs_extras)
    for provider in needed:
        provider.check(cache, input_ids, attention_mask, tokenizer)

    B, T = input_ids.shape
    device = input_ids.device
    mask = (
        torch.ones(B, T, dtype=torch.long, device=device)
        if attention_mask is None
        else attention_mask.to(device).long()
    )
    seen = cache.get_seq_length()
    start = cache.next_positions()
    start = torch.zeros(B, dtype=torch.long, device=device) if start is None else start.to(device)
    positions = start[:, None] + (mask.cumsum(-1) - 1).clamp_min(0)
    full_mask = torch.cat([torch.ones(B, seen, dtype=torch.long, device=device), mask], 1)

    cache.collect()
    step = T if chunk_size is None else chunk_size
    out = None
    with contextlib.ExitStack() as stack:  # providers that read the prefill's own activations (surprisal)
        captured = {p.name: stack.enter_context(p.capture(model)) for p in needed if p.capture is not None}
        for a in range(0, T, step):
            b = min(a + step, T)
            out = model(
                input_ids=input_ids[:, a:b],
                attention_mask=full_mask[:, : seen + b],
                position_ids=positions[:, a:b],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
    logits = out.logits[:, -1]
    extras = None
    if needed:
        with cache.timed():
            extras = providers.run_providers(
                needed,
                model,
                cache,
                input_ids,
                tokenizer=tokenizer,
                context_start=context_start,
                configs=provider_options,
                captured=captured,
                attention_mask=mask,
            )
    cache.compress(extras=extras, protect_before=context_start or None)
    return logits


def chunk_compressor(compressor: Compressor, prompt_length: int) -> Compressor:
    """The compressor each chunk step of a ``prompt_length``-token chunked prefill uses: a ratio budget becomes
    the token count one-shot compression keeps for the whole prompt (``budget.kept(prompt_length)``, at least
    1), so every step keeps at most that many entries per head and the last step ends exactly there; token and
    average-bits budgets are used as they are."""
    budget = compressor.budget
    if budget.ratio is None:
        return compressor
    return compressor.with_budget(ratio=None, tokens=max(1, budget.kept(prompt_length)))


def _check_chunked(cache: CompressedCache, chunk_size: int | None, attention_mask: torch.Tensor | None) -> None:
    scorer = cache.compressor.scorer
    if chunk_size is None:
        raise ValueError("compress_chunks=True needs chunk_size=N (the number of prompt tokens per chunk)")
    if not scorer.chunkable:
        raise ValueError(
            f"scorer {type(scorer).__name__} does not declare chunkable = True, so compress_chunks=True cannot "
            "compress it chunk by chunk; drop compress_chunks (the prompt is then compressed once, at the end) or "
            "use a chunkable scorer (key-only, StreamingLLM, H2O, SnapKV)"
        )
    if scorer.needs_extras:
        raise ValueError(
            f"compress_chunks=True cannot supply the extras {sorted(scorer.needs_extras)} that "
            f"{type(scorer).__name__} declares per chunk; drop compress_chunks"
        )
    if cache.compressor.budget.granularity == "global":
        raise ValueError(
            "compress_chunks=True needs a 'head' or 'layer' budget: a 'global' budget selects over all layers at "
            "once, from the whole prompt"
        )
    if cache.get_seq_length():
        raise ValueError(
            f"compress_chunks=True needs an empty cache (it holds {cache.get_seq_length()} token slots): the "
            "budget is the whole prompt's; prefill the earlier context without compress_chunks"
        )
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError(
            "compress_chunks=True needs unpadded rows (attention_mask all ones): a padded chunk cannot be merged "
            "into a compressed layer; prefill rows separately"
        )


def _prefill_chunked(
    model: PreTrainedModel,
    cache: CompressedCache,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    chunk_size: int | None,
    context_start: int,
) -> torch.Tensor:
    """``prefill(..., compress_chunks=True)``: run ``chunk_size`` tokens at a time, compressing after each."""
    _check_chunked(cache, chunk_size, attention_mask)
    B, T = input_ids.shape
    device = input_ids.device
    positions = torch.arange(T, device=device)[None, :].expand(B, T)
    compressor = chunk_compressor(cache.compressor, T)
    protect_before = context_start or None
    out = None
    for a in range(0, T, chunk_size):
        b = min(a + chunk_size, T)
        cache.collect()
        if cache.query_window is None:  # every-query scorers (H2O) score each step with this chunk's queries
            for layer in cache.compressed:
                layer.queries = None
        out = model(
            input_ids=input_ids[:, a:b],
            attention_mask=torch.ones(B, b, dtype=torch.long, device=device),
            position_ids=positions[:, a:b],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache.compress(protect_before=protect_before, compressor=compressor)
    return out.logits[:, -1]
