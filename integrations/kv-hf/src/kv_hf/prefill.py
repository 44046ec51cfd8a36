"""Explicit prefill: collect a prompt (optionally in chunks), supply the scorer's extras through the named
providers (:mod:`kv_hf.providers`), compress once."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from kv_hf import providers
from kv_hf.cache import CompressedCache

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
        Prefill chunk length (peak activation memory); the collected K/V are held raw until the end.
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
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if (
        isinstance(context_start, bool)
        or not isinstance(context_start, int)
        or not 0 <= context_start < input_ids.shape[1]
    ):
        raise ValueError(f"context_start must be an int in [0, {input_ids.shape[1]}), got {context_start!r}")
    unknown = sorted(set(provider_options) - providers.options())
    if unknown:
        raise TypeError(f"unknown prefill options {unknown}; provider options: {sorted(providers.options())}")
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
