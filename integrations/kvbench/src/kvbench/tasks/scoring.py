"""Scoring of predictions: the fraction of expected answers found in the generated text."""

from __future__ import annotations

import re

from kvbench.tasks.sample import TaskSample


def contains_answer(prediction: str, answer: str) -> bool:
    """Whether ``answer`` occurs in ``prediction`` as a whole token.

    Matching is case-insensitive and the match may not be glued to further letters or digits
    (``"71432"`` is not found in ``"714321"``; ``"ABCDE"`` not in ``"XABCDE"``).

    Parameters
    ----------
    prediction : str
        Generated text.
    answer : str
        Expected string.

    Returns
    -------
    bool
    """
    if not isinstance(prediction, str):
        raise TypeError(f"prediction must be a str, got {type(prediction).__name__}")
    if not isinstance(answer, str) or not answer:
        raise ValueError(f"answer must be a non-empty str, got {answer!r}")
    pattern = r"(?<![0-9A-Za-z])" + re.escape(answer) + r"(?![0-9A-Za-z])"
    return re.search(pattern, prediction, flags=re.IGNORECASE) is not None


def score(prediction: str, sample: TaskSample) -> float:
    """Score a prediction against a sample: the fraction of ``sample.answers`` it contains.

    Single-answer tasks therefore score 0 or 1; multi-value needles and variable tracking get
    partial credit (1.0 only when every answer appears), as RULER's ``string_match_all``.

    Parameters
    ----------
    prediction : str
        The model's continuation of ``sample.prompt`` (without the prompt).
    sample : TaskSample
        The sample.

    Returns
    -------
    float
        In ``[0, 1]``.
    """
    if not isinstance(sample, TaskSample):
        raise TypeError(f"sample must be a TaskSample, got {type(sample).__name__}")
    if not sample.answers:
        raise ValueError("sample.answers is empty")
    return sum(contains_answer(prediction, a) for a in sample.answers) / len(sample.answers)
