"""Sentence segmentation of a prompt by punctuation tokens (SentenceKV, Zhu et al. 2025, arXiv:2504.00970, §3,
prefilling stage; the authors' code splits after every token whose id is in a list of punctuation ids)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from kvcore.checks import check_integer_tensor

PUNCTUATION: tuple[str, ...] = (".", "!", "?", "\n", "。", "！", "？")
"""Text a sentence-ending token ends with (after trailing spaces are stripped; a newline counts anywhere)."""


def is_sentence_end(text: str, punctuation: Iterable[str] = PUNCTUATION) -> bool:
    """Whether a token decoding to ``text`` ends a sentence: it ends with one of ``punctuation`` once trailing spaces
    and tabs are stripped, or holds a newline (when ``"\\n"`` is in ``punctuation``)."""
    marks = tuple(punctuation)
    if "\n" in marks and "\n" in text:
        return True
    stripped = text.rstrip(" \t")
    return bool(stripped) and stripped.endswith(marks)


def sentence_ids(input_ids: torch.Tensor, is_end: Callable[[int], bool]) -> torch.Tensor:
    """``[B, T]`` int64 sentence index of every token: a sentence ends at (and includes) every token ``is_end``
    accepts, so token ``t``'s index is the number of sentence ends before it in its row.

    Parameters
    ----------
    input_ids : Tensor
        ``[B, T]`` token ids.
    is_end : callable
        ``is_end(token_id) -> bool``: whether that token ends a sentence (e.g. ``is_sentence_end`` of its text).
    """
    ids = check_integer_tensor("input_ids", input_ids, ndim=2)
    if not callable(is_end):
        raise TypeError(f"is_end must be callable, got {type(is_end).__name__}")
    lookup = {int(i): bool(is_end(int(i))) for i in torch.unique(ids).tolist()}
    ends = torch.tensor([[lookup[int(i)] for i in row] for row in ids.tolist()], dtype=torch.long).view(ids.shape)
    return (ends.cumsum(-1) - ends).to(ids.device)
