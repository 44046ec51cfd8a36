"""English text for haystacks and teacher-forced evaluation: gensim's ``lee_background.cor``.

The corpus (300 Australian news stories, ~360 KB, ~76k SmolLM2 tokens, one story per line) ships in
the ``gensim`` wheel as test data.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvbench.tasks.tokens import check_count, check_tokenizer, encode
from kvcore.checks import check_int

LEE_FILENAME = "lee_background.cor"

CALIBRATION_STORIES = range(270, 300)
"""The stories (lines) of ``lee_background.cor`` held out for calibration: the last 30 of 300, ~32k characters,
~7.5k SmolLM2 tokens. Methods that tune on text (HqeKV's ratio search, ``kv-hqekv search``) calibrate on
``lee_background(part="calibration")``; kvbench's teacher-forced windows are cut from ``part="evaluation"``,
the other 270 stories, so calibration text is never evaluated on."""

PARTS = ("all", "evaluation", "calibration")


@functools.lru_cache(maxsize=1)
def _lee_path() -> Path:
    # Locate the file without importing gensim (the import takes ~5 s); fall back to its helper.
    spec = importlib.util.find_spec("gensim")
    if spec is None:
        raise ModuleNotFoundError(
            "the English text corpus comes from gensim's test data; install it with `pip install gensim`",
            name="gensim",
        )
    for loc in spec.submodule_search_locations or ():
        p = Path(loc) / "test" / "test_data" / LEE_FILENAME
        if p.is_file():
            return p
    from gensim.test.utils import datapath

    return Path(datapath(LEE_FILENAME))


@functools.lru_cache(maxsize=1)
def _lee_text() -> str:
    return _lee_path().read_text(encoding="utf-8")


def lee_background(tokenizer: Any = None, part: str = "all") -> str | list[int]:
    """Return the ``lee_background.cor`` corpus, or one part of it.

    Parameters
    ----------
    tokenizer : TokenizerLike, optional
        When given, return the token ids of the text (no special tokens) instead.
    part : {"all", "evaluation", "calibration"}
        The whole corpus, the stories kvbench evaluates on, or the held-out :data:`CALIBRATION_STORIES`.

    Returns
    -------
    str or list of int
        The text (stories separated by newlines), or its token ids.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    text = _lee_text()
    if part != "all":
        lines = text.splitlines(keepends=True)
        held_out = set(CALIBRATION_STORIES)
        text = "".join(line for i, line in enumerate(lines) if (i in held_out) == (part == "calibration"))
    if tokenizer is None:
        return text
    return encode(check_tokenizer(tokenizer), text)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(]?[A-Z0-9])")


@functools.lru_cache(maxsize=1)
def lee_sentences() -> tuple[str, ...]:
    """The corpus split into sentences, in corpus order (a simple punctuation-based split).

    Returns
    -------
    tuple of str
    """
    out: list[str] = []
    for line in _lee_text().splitlines():
        line = " ".join(line.split())
        if line:
            out.extend(s for s in _SENTENCE_END.split(line) if s)
    return tuple(out)


def continuation_split(
    text: str,
    tokenizer: Any,
    context_tokens: int,
    continuation_tokens: int,
    n: int,
    seed: int = 0,
) -> Iterator[tuple[list[int], list[int]]]:
    """Cut ``n`` non-overlapping (context, continuation) token windows from ``text``.

    For teacher-forced evaluation: run the model on ``context_ids`` (compressing its KV cache),
    then score ``continuation_ids`` token by token (KL to the full-cache model, perplexity).

    The token stream is divided into consecutive slots of ``context_tokens + continuation_tokens``;
    ``n`` slots are drawn without replacement with ``random.Random(seed)`` and yielded in stream order.

    Parameters
    ----------
    text : str
        Source text, e.g. :func:`lee_background`.
    tokenizer : TokenizerLike
        Used to tokenize ``text`` once (no special tokens).
    context_tokens, continuation_tokens : int
        Window sizes, ``>= 1``.
    n : int
        Number of pairs, ``>= 1``.
    seed : int
        Seed of the slot choice.

    Yields
    ------
    context_ids, continuation_ids : list of int
        Adjacent windows of the token stream.

    Raises
    ------
    ValueError
        If ``text`` is too short for ``n`` windows.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    check_tokenizer(tokenizer)
    c = check_count(context_tokens, "context_tokens")
    k = check_count(continuation_tokens, "continuation_tokens")
    check_count(n, "n")
    check_int("seed", seed)
    ids = encode(tokenizer, text)
    window = c + k
    slots = len(ids) // window
    if n > slots:
        raise ValueError(
            f"n={n} windows of context_tokens + continuation_tokens = {window} do not fit in the text "
            f"({len(ids)} tokens, room for {slots})"
        )
    for s in sorted(random.Random(seed).sample(range(slots), n)):
        start = s * window
        yield ids[start : start + c], ids[start + c : start + window]
