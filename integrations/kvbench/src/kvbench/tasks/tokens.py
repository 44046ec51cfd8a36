"""Token counting through any tokenizer with an ``encode`` method, and argument checks."""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable

from kvcore.checks import check_int


@runtime_checkable
class TokenizerLike(Protocol):
    """What the generators need from a tokenizer: ``encode(text) -> list of ids``.

    A ``transformers`` tokenizer qualifies; ``add_special_tokens=False`` is passed when accepted.
    """

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...


def check_tokenizer(tokenizer: Any) -> Any:
    """Return ``tokenizer`` or raise ``TypeError`` naming the argument.

    Parameters
    ----------
    tokenizer : object
        Must have a callable ``encode``.
    """
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(f"tokenizer must have an encode(text) method, got {type(tokenizer).__name__}")
    return tokenizer


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (BOS/EOS).

    Parameters
    ----------
    tokenizer : TokenizerLike
    text : str

    Returns
    -------
    list of int
    """
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:
        ids = tokenizer.encode(text)
    return list(ids)


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens of ``text`` without special tokens."""
    return len(encode(tokenizer, text)) if text else 0


def check_length(length: Any, name: str = "length") -> int:
    """Validate a positive integer token length."""
    return check_int(name, length, low=1)


def check_depth(depth: Any, name: str = "depth") -> float:
    """Validate a depth in ``[0, 1]``."""
    if isinstance(depth, bool) or not isinstance(depth, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(depth).__name__}")
    depth = float(depth)
    if not math.isfinite(depth) or not 0.0 <= depth <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {depth}")
    return depth


def check_count(value: Any, name: str, minimum: int = 1) -> int:
    """Validate an integer count ``>= minimum``."""
    return check_int(name, value, low=minimum)
