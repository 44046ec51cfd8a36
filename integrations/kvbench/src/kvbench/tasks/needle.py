"""Needle-in-a-haystack in English news text, RULER style: single, multi-key and multi-value.

The haystack is a contiguous run of sentences from ``lee_background.cor`` (starting at a
seeded sentence, wrapping around at the end of the corpus, ~76k SmolLM2 tokens before any
repetition). Needles read ``"One of the special magic numbers for {key} is: {value}."`` with
``adjective-noun`` keys and 7-digit values.
"""

from __future__ import annotations

import random
from typing import Any

from kvbench.tasks.haystack import answers_only_in_needles, build_context
from kvbench.tasks.sample import TaskSample
from kvbench.tasks.text import lee_sentences
from kvbench.tasks.tokens import check_count, check_depth, check_length, check_tokenizer, count_tokens
from kvbench.tasks.values import random_key, random_number, unique

PREAMBLE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {value}."
QUESTION_ONE = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
QUESTION_ALL = (
    "\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
    "The special magic numbers for {key} mentioned in the provided text are"
)


def _niah(
    name: str,
    tokenizer: Any,
    length: int,
    depth: float,
    seed: int,
    num_keys: int,
    num_values: int,
    digits: int,
    max_new_tokens: int,
) -> TaskSample:
    check_tokenizer(tokenizer)
    length = check_length(length)
    depth = check_depth(depth)
    check_count(num_keys, "num_keys")
    check_count(num_values, "num_values")
    check_count(digits, "digits", 4)
    check_count(max_new_tokens, "max_new_tokens")
    rng = random.Random(seed)
    sentences = lee_sentences()
    start = rng.randrange(len(sentences))

    def unit(i: int) -> str:
        return sentences[(start + i) % len(sentences)]

    for _ in range(20):
        keys = unique(random_key, rng, num_keys)
        values = unique(lambda r: random_number(r, digits), rng, num_keys * num_values)
        query = keys[0]
        answers = values[:num_values]
        # the queried key's first value sits at `depth`; further values and distractor keys at random depths
        needles: list[tuple[float, str]] = [(depth, NEEDLE.format(key=query, value=answers[0]))]
        others = [(query, v) for v in answers[1:]]
        others += [(k, values[num_values * ki + vi]) for ki, k in enumerate(keys[1:], 1) for vi in range(num_values)]
        rng.shuffle(others)
        needles += [(rng.random(), NEEDLE.format(key=k, value=v)) for k, v in others]
        question = (QUESTION_ALL if num_values > 1 else QUESTION_ONE).format(key=query)
        built = build_context(
            tokenizer, length, preamble=PREAMBLE, question=question, units=unit, needles=needles, task=name
        )
        texts = [t for _, t in needles]
        if answers_only_in_needles(built.context, values + keys, texts):
            break
    else:  # pragma: no cover - the corpus holds no 7-digit numbers
        raise RuntimeError(f"could not place unique needles for {name}")
    per_answer = count_tokens(tokenizer, " " + answers[0]) + 2
    return built.sample(
        question=question,
        answers=answers,
        needles=texts,
        target_length=length,
        depth=depth,
        seed=seed,
        task=name,
        kind="multi_retrieval" if num_values > 1 else "retrieval",
        max_new_tokens=max(max_new_tokens, per_answer * num_values),
        key=query,
        keys=keys,
        corpus_start_sentence=start,
    )


def niah_single(
    tokenizer: Any, length: int, depth: float = 0.5, seed: int = 0, *, digits: int = 7, max_new_tokens: int = 12
) -> TaskSample:
    """One needle in English text; ask its value.

    Parameters
    ----------
    tokenizer : TokenizerLike
        Sizes the prompt.
    length : int
        Target tokens of ``context + question``.
    depth : float
        Fraction of the haystack before the needle, in ``[0, 1]``.
    seed : int
        Seed of the key, value and corpus start.
    digits : int
        Digits of the value (``>= 4``).
    max_new_tokens : int
        Generation budget.

    Returns
    -------
    TaskSample
    """
    return _niah("niah_single", tokenizer, length, depth, seed, 1, 1, digits, max_new_tokens)


def niah_multikey(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    *,
    num_keys: int = 4,
    digits: int = 7,
    max_new_tokens: int = 12,
) -> TaskSample:
    """``num_keys`` needles with different keys; ask the value of the one at ``depth``.

    Parameters
    ----------
    tokenizer, length, depth, seed, digits, max_new_tokens
        As in :func:`niah_single`; the distractor needles sit at seeded random depths.
    num_keys : int
        Needles in total (``>= 1``).

    Returns
    -------
    TaskSample
    """
    return _niah("niah_multikey", tokenizer, length, depth, seed, num_keys, 1, digits, max_new_tokens)


def niah_multivalue(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    *,
    num_values: int = 4,
    digits: int = 7,
    max_new_tokens: int = 12,
) -> TaskSample:
    """One key with ``num_values`` values in separate needles; all must be recalled.

    Parameters
    ----------
    tokenizer, length, seed, digits, max_new_tokens
        As in :func:`niah_single` (``max_new_tokens`` is raised to cover all values).
    depth : float
        Depth of the first value's needle; the others sit at seeded random depths.
    num_values : int
        Values of the key (``>= 1``).

    Returns
    -------
    TaskSample
        ``score`` is the fraction of values in the prediction.
    """
    return _niah("niah_multivalue", tokenizer, length, depth, seed, 1, num_values, digits, max_new_tokens)
