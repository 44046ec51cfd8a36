"""Query-agnostic reuse: compress one context once, answer several questions (kvpress pipeline).

kvpress's ``kv-press-text-generation`` pipeline prefills the context under the press, then greedy-decodes each
question with explicit ``position_ids`` starting at the context length and crops the answer back out, so one
compressed context serves every question. Same protocol here, on a real compressed cache: the question and
answer tokens are appended to the Stores and rolled back afterwards (``Store.crop`` at the context length in true
positions).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kv_hf.cache import CompressedCache, compressed_cache
from kv_hf.prefill import prefill
from kvcore.checks import check_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kvcore import Compressor


@torch.no_grad()
def generate_answer(
    model: PreTrainedModel,
    cache: CompressedCache,
    question_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    keep: bool = False,
) -> torch.Tensor:
    """Greedy-decode an answer to ``question_ids`` after what ``cache`` holds, with explicit true positions.

    Parameters
    ----------
    model, cache
        The model and its (compressed) cache holding the context.
    question_ids : Tensor
        ``[B, q]`` question tokens (no padding; use ``B = 1`` for contexts prefilled with left padding).
    max_new_tokens : int
        Answer length limit.
    eos_token_id : int or sequence of int, optional
        Stop when every row produced one of these.
    keep : bool
        Keep the question and answer in the cache (multi-turn); by default they are rolled back.

    Returns
    -------
    Tensor
        ``[B, n]`` generated token ids (``n <= max_new_tokens``; rows that finished early repeat their EOS).
    """
    if not isinstance(cache, CompressedCache):
        raise TypeError(f"cache must be a kv_hf.CompressedCache, got {type(cache).__name__}")
    if not isinstance(question_ids, torch.Tensor) or question_ids.ndim != 2 or question_ids.shape[1] == 0:
        raise ValueError("question_ids must be an integer tensor [B, q] with q >= 1")
    check_int("max_new_tokens", max_new_tokens, low=1)
    if not keep and cache.options.recompress_every:
        raise ValueError(
            "answers cannot be rolled back exactly when periodic re-compression may prune the context while "
            "decoding; build the cache without recompress_every for multi-question reuse"
        )
    eos = None if eos_token_id is None else torch.as_tensor(eos_token_id, device=question_ids.device).flatten()
    B, q = question_ids.shape
    length = cache.get_seq_length()
    start = cache.next_positions()
    start = (
        torch.zeros(B, dtype=torch.long, device=question_ids.device) if start is None else start.to(question_ids.device)
    )
    pos = start[:, None] + torch.arange(q, device=question_ids.device)
    tokens = []
    done = torch.zeros(B, dtype=torch.bool, device=question_ids.device)
    paused, since = cache.replan_paused, [layer._since for layer in cache.compressed]
    cache.replan_paused = paused or not keep  # a method's own re-plan would change the context for good
    with contextlib.ExitStack() as stack:
        if not keep:  # sliding windows keep what slides out of them, so that the rollback can restore it
            stack.enter_context(cache.held())
        try:
            out = model(
                input_ids=question_ids, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1
            )
            for i in range(max_new_tokens):
                nxt = out.logits[:, -1].argmax(-1)
                if eos is not None:
                    nxt = torch.where(done, eos[0], nxt)
                    done = done | torch.isin(nxt, eos)
                tokens.append(nxt)
                if i == max_new_tokens - 1 or bool(done.all()):
                    break
                pos = pos[:, -1:] + 1
                out = model(
                    input_ids=nxt[:, None], past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1
                )
        finally:
            cache.replan_paused = paused
            if not keep:
                cache.rollback(length)
                for layer, n in zip(cache.compressed, since):
                    layer._since = n
    return torch.stack(tokens, 1)


@torch.no_grad()
def answer_questions(
    model: PreTrainedModel,
    tokenizer: Any,
    context: str,
    questions: Sequence[str],
    compressor: Compressor,
    max_new_tokens: int = 32,
    *,
    answer_prefix: str = "",
    **cache_options: Any,
) -> list[str]:
    """Compress ``context`` once with ``compressor`` and answer every question from the same compressed cache.

    The context is encoded with special tokens (BOS), questions without; plain completion (no chat template),
    greedy decoding with explicit positions, each answer rolled back before the next question.

    Parameters
    ----------
    model : PreTrainedModel
    tokenizer
        An object with ``encode(text, add_special_tokens=...)``, ``decode(ids, skip_special_tokens=True)`` and
        optionally ``eos_token_id``.
    context : str
    questions : sequence of str
    compressor : kvcore.Compressor
    max_new_tokens : int
    answer_prefix : str
        Appended to every question (e.g. ``" Answer:"``).
    **cache_options
        Passed to :func:`kv_hf.compressed_cache` (``query_window`` ...).

    Returns
    -------
    list of str
        One decoded answer per question.
    """
    if isinstance(questions, str):
        raise TypeError("questions must be a sequence of strings, not a single string")
    device = next(model.parameters()).device
    ctx_ids = torch.tensor([list(tokenizer.encode(context, add_special_tokens=True))], dtype=torch.long, device=device)
    cache = compressed_cache(model, compressor, **cache_options)
    prefill(model, cache, ctx_ids, tokenizer=tokenizer)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    answers = []
    for question in questions:
        ids = tokenizer.encode(question + answer_prefix, add_special_tokens=False)
        q_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        out = generate_answer(model, cache, q_ids, max_new_tokens, eos_token_id=eos)
        answers.append(tokenizer.decode(out[0].tolist(), skip_special_tokens=True))
    return answers
