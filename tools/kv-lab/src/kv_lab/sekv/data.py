"""Training data: a plain-text corpus cut into token sequences, split into training and held-out parts (§4.1 uses
long RedPajama documents; the small recipe uses one local text file)."""

from __future__ import annotations

from typing import Any

import torch

from kvcore.checks import check_int

__all__ = ["corpus_sequences", "split_sequences"]


def corpus_sequences(text: str, tokenizer: Any, seq_len: int) -> torch.Tensor:
    """``[N, seq_len]`` int64 consecutive, non-overlapping windows of the tokenized ``text`` (the tail is dropped)."""
    check_int("seq_len", seq_len, low=2)
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = torch.as_tensor(list(ids), dtype=torch.long)
    n = ids.numel() // seq_len
    if n == 0:
        raise ValueError(f"the corpus has {ids.numel()} tokens, fewer than seq_len={seq_len}")
    return ids[: n * seq_len].view(n, seq_len)


def split_sequences(seqs: torch.Tensor, held_out: float = 0.1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded ``(train, held_out)`` split of the rows of ``seqs`` (at least one row each when there are two)."""
    if not 0.0 < held_out < 1.0:
        raise ValueError(f"held_out must lie in (0, 1), got {held_out}")
    n = seqs.shape[0]
    if n < 2:
        raise ValueError(f"need at least 2 sequences to split, got {n}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    k = min(n - 1, max(1, round(n * held_out)))
    return seqs[order[k:]], seqs[order[:k]]
