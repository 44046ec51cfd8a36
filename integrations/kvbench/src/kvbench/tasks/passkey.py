"""Passkey retrieval: a 5-digit key hidden in repeated filler (Mohtashami & Jaggi 2023; LongLoRA)."""

from __future__ import annotations

import random
from typing import Any

from kvbench.tasks.haystack import answers_only_in_needles, build_context
from kvbench.tasks.sample import TaskSample
from kvbench.tasks.tokens import check_count, check_depth, check_length, check_tokenizer, count_tokens
from kvbench.tasks.values import random_number

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
FILLER_SENTENCES = tuple(s if s.endswith(".") else s + "." for s in FILLER.split(". "))
#: Optional instructions (LongLoRA's). Off by default: with them SmolLM2-135M found the key at
#: depth 0.1 of a 2k-token prompt in 2/4 seeds, without them in 4/4.
INSTRUCTIONS = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "\nWhat is the pass key? The pass key is"


def filler_unit(i: int) -> str:
    """Filler sentence ``i`` of the endlessly repeated :data:`FILLER`."""
    return FILLER_SENTENCES[i % len(FILLER_SENTENCES)]


def passkey(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    *,
    digits: int = 5,
    max_new_tokens: int = 8,
    preamble: str = "",
) -> TaskSample:
    """Generate one passkey sample.

    Parameters
    ----------
    tokenizer : TokenizerLike
        Sizes the prompt.
    length : int
        Target tokens of ``context + question``.
    depth : float
        Fraction of the filler before the key, in ``[0, 1]``.
    seed : int
        Seed of the key.
    digits : int
        Digits of the key.
    max_new_tokens : int
        Generation budget.
    preamble : str
        Text before the filler, e.g. :data:`INSTRUCTIONS`; none by default, so the context is
        filler and needle only.

    Returns
    -------
    TaskSample
        ``answers == [key]``.
    """
    check_tokenizer(tokenizer)
    length = check_length(length)
    depth = check_depth(depth)
    check_count(digits, "digits")
    check_count(max_new_tokens, "max_new_tokens")
    if not isinstance(preamble, str):
        raise TypeError(f"preamble must be a str, got {type(preamble).__name__}")
    rng = random.Random(seed)
    for _ in range(20):
        key = random_number(rng, digits)
        needle = NEEDLE.format(key=key)
        built = build_context(
            tokenizer,
            length,
            preamble=preamble,
            question=QUESTION,
            units=filler_unit,
            needles=[(depth, needle)],
            task="passkey",
        )
        if answers_only_in_needles(built.context, [key], [needle]):
            break
    else:  # pragma: no cover - the filler holds no digits
        raise RuntimeError("could not place a unique pass key")
    return built.sample(
        question=QUESTION,
        answers=[key],
        needles=[needle],
        target_length=length,
        depth=depth,
        seed=seed,
        task="passkey",
        kind="retrieval",
        max_new_tokens=max(max_new_tokens, count_tokens(tokenizer, " " + key) + 2),
    )
