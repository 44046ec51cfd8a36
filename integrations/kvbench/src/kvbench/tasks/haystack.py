"""Build a context of a target token length with needles at given depths.

Every generator reduces to: instructions (``preamble``), a haystack made of *units* (filler
sentences, corpus sentences, JSON records) with *needles* inserted between units, an optional
``suffix``, then the ``question``. :func:`build_context` picks how many units to use so that
``context + question`` has the requested number of tokens (within ~1%, measured with the tokenizer
itself), and places each needle at the unit boundary whose token position is closest to its depth.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvbench.tasks.sample import TaskSample
from kvbench.tasks.tokens import count_tokens


@dataclass
class BuiltContext:
    """Result of :func:`build_context`.

    Parameters
    ----------
    context : str
        Preamble + haystack (with needles) + suffix.
    length : int
        Measured tokens of ``context + question``.
    haystack_start, haystack_end : int
        Character span of the haystack in ``context``.
    needle_offsets : list of int
        Character offset of each needle in ``context``, in the order the needles were given.
    needle_depths : list of float
        Realised depth of each needle: the fraction of the haystack's non-needle tokens that come
        before it (0: before all filler, 1: after all of it).
    n_units : int
        Number of haystack units used (a trailing partial unit counts as one).
    """

    context: str
    length: int
    haystack_start: int
    haystack_end: int
    needle_offsets: list[int] = field(default_factory=list)
    needle_depths: list[float] = field(default_factory=list)
    n_units: int = 0

    def sample(
        self,
        *,
        question: str,
        answers: Sequence[str],
        needles: Sequence[str],
        target_length: int,
        depth: float,
        seed: int,
        task: str,
        kind: str,
        max_new_tokens: int,
        **info: Any,
    ) -> TaskSample:
        """The :class:`~kvbench.tasks.sample.TaskSample` of this context: its ``info`` holds the inserted ``needles``,
        where they landed (``needle_offsets``, ``needle_depths``), the haystack's span, then the task's own ``info``
        entries."""
        return TaskSample(
            context=self.context,
            question=question,
            answers=list(answers),
            max_new_tokens=max_new_tokens,
            task=task,
            kind=kind,
            length=self.length,
            target_length=target_length,
            depth=depth,
            seed=seed,
            info={
                "needles": list(needles),
                "needle_offsets": self.needle_offsets,
                "needle_depths": self.needle_depths,
                "haystack_start": self.haystack_start,
                "haystack_end": self.haystack_end,
                **info,
            },
        )


class UnitStream:
    """Memoised, indexable stream of haystack units produced by ``make(i)``."""

    def __init__(self, make: Callable[[int], str]) -> None:
        self._make = make
        self._items: list[str] = []

    def __getitem__(self, i: int) -> str:
        while len(self._items) <= i:
            self._items.append(self._make(len(self._items)))
        return self._items[i]


def build_context(
    tokenizer: Any,
    length: int,
    *,
    preamble: str,
    question: str,
    units: Callable[[int], str],
    needles: Sequence[tuple[float, str]],
    joiner: str = " ",
    suffix: str = "",
    partial: bool = True,
    task: str = "",
) -> BuiltContext:
    """Assemble ``preamble + haystack + suffix`` so that, with ``question``, it has ``length`` tokens.

    Parameters
    ----------
    tokenizer : TokenizerLike
        Sizes everything.
    length : int
        Target tokens of ``context + question``.
    preamble, question, suffix : str
        Fixed texts before the haystack, after the context, and closing the haystack.
    units : callable
        ``units(i)`` returns haystack unit ``i`` (deterministic; called with ``0, 1, 2 ...``).
    needles : sequence of (depth, text)
        Texts to insert and their depths in ``[0, 1]``.
    joiner : str
        Separator between units and needles.
    partial : bool
        Allow a leading word-prefix of one more unit to fill the last few tokens (off for
        structured units such as JSON records, which are then rounded to the closest count).
    task : str
        Name used in error messages.

    Returns
    -------
    BuiltContext

    Raises
    ------
    ValueError
        If ``length`` cannot hold the preamble, needles and question plus some haystack.
    """
    cache: dict[str, int] = {}

    def cost(text: str) -> int:
        if text not in cache:
            cache[text] = count_tokens(tokenizer, text)
        return cache[text]

    stream = UnitStream(units)
    fixed = cost(preamble) + cost(suffix) + cost(question) + sum(cost(joiner + t) for _, t in needles)
    budget = length - fixed
    if budget < 1:
        what = f"task {task!r}: " if task else ""
        raise ValueError(
            f"length={length} is too small for {what}the instructions, needle(s) and question alone take {fixed} tokens"
        )
    tol = max(1, length // 100)
    best: BuiltContext | None = None
    for _ in range(5):
        chosen = _select_units(stream, budget, joiner, partial, cost)
        built = _compose(tokenizer, chosen, needles, preamble, question, suffix, joiner, cost)
        if best is None or abs(built.length - length) < abs(best.length - length):
            best = built
        err = built.length - length
        if abs(err) <= tol:
            break
        budget -= err
        if budget < 1:
            break
    assert best is not None
    return best


def _select_units(stream: UnitStream, budget: int, joiner: str, partial: bool, cost) -> list[str]:
    chosen: list[str] = []
    used = 0
    i = 0
    while True:
        u = stream[i]
        c = cost(joiner + u)
        if c < 1:
            raise ValueError(f"haystack unit {i} has no tokens: {u!r}")
        if used + c > budget:
            break
        chosen.append(u)
        used += c
        i += 1
    rest = budget - used
    if rest > 0:
        u = stream[i]
        if partial:
            words = u.split(" ")
            best = ""
            for j in range(1, len(words)):
                piece = " ".join(words[:j])
                if cost(joiner + piece) > rest:
                    break
                best = piece
            if best:
                chosen.append(best)
        elif 2 * rest >= cost(joiner + u) or not chosen:
            chosen.append(u)
    return chosen


def _compose(tokenizer, chosen, needles, preamble, question, suffix, joiner, cost) -> BuiltContext:
    # boundary j sits before unit j (j == len(chosen): after the last unit)
    pos = [0]
    for u in chosen:
        pos.append(pos[-1] + cost(joiner + u))
    total = pos[-1]
    at: dict[int, list[int]] = {}
    for k, (depth, _) in enumerate(needles):
        target = depth * total
        j = min(range(len(pos)), key=lambda b: (abs(pos[b] - target), b))
        at.setdefault(j, []).append(k)

    items: list[tuple[int | None, str]] = []  # (needle index or None, text)
    for j in range(len(chosen) + 1):
        for k in at.get(j, ()):
            items.append((k, needles[k][1]))
        if j < len(chosen):
            items.append((None, chosen[j]))

    parts = [preamble]
    offset = len(preamble)
    offsets = [0] * len(needles)
    filler_before = [0] * len(needles)
    filler = 0
    for n, (k, text) in enumerate(items):
        if n:
            parts.append(joiner)
            offset += len(joiner)
        if k is not None:
            offsets[k] = offset
            filler_before[k] = filler
        else:
            filler += cost(joiner + text)
        parts.append(text)
        offset += len(text)
    haystack_end = offset
    parts.append(suffix)
    context = "".join(parts)
    depths = [fb / filler if filler else 0.0 for fb in filler_before]
    return BuiltContext(
        context=context,
        length=count_tokens(tokenizer, context + question),
        haystack_start=len(preamble),
        haystack_end=haystack_end,
        needle_offsets=offsets,
        needle_depths=depths,
        n_units=len(chosen),
    )


def occurrences(text: str, value: str) -> int:
    """Count occurrences of ``value`` in ``text`` not glued to further letters or digits."""
    import re

    return len(re.findall(r"(?<![0-9A-Za-z])" + re.escape(value) + r"(?![0-9A-Za-z])", text))


def answers_only_in_needles(context: str, answers: Sequence[str], needle_texts: Sequence[str]) -> bool:
    """Whether every answer occurs in ``context`` exactly as often as in the needles."""
    return all(occurrences(context, a) == sum(occurrences(t, a) for t in needle_texts) for a in answers)
