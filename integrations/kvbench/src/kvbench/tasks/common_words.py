"""Common-words extraction (RULER's CWE, Hsieh et al. 2024, Sec. 3): name the most frequent words of a long list.

A numbered list of words from ``lee_background.cor``'s vocabulary: ``num_common`` words appear ``freq_common``
times each, every other word ``freq_rare`` times, in a seeded random order; the list grows until the prompt has
the requested length. The model must aggregate over the whole context, not retrieve one span, so evicting
"unimportant" tokens hurts differently from the needle tasks. RULER uses 10 common words; the default here is 3,
which a 135M model has a chance at (the full-cache accuracy in every report shows whether it does).
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any

from kvbench.tasks.sample import TaskSample
from kvbench.tasks.text import lee_sentences
from kvbench.tasks.tokens import check_count, check_depth, check_length, check_tokenizer, count_tokens

PREAMBLE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
QUESTION = (
    "\nQuestion: What are the {n} most common words in the above list? "
    "Answer: The top {n} words appearing most often in the list are:"
)


@functools.lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """Distinct lowercase alphabetic words of 4-10 letters from the corpus, in first-seen order."""
    seen: dict[str, None] = {}
    for s in lee_sentences():
        for w in re.findall(r"[A-Za-z]+", s):
            if 4 <= len(w) <= 10 and w.islower():
                seen.setdefault(w, None)
    return tuple(seen)


def _render(words: list[str]) -> str:
    return "".join(f"{i + 1}. {w}\n" for i, w in enumerate(words))


def common_words(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    *,
    num_common: int = 3,
    freq_common: int = 10,
    freq_rare: int = 2,
    max_new_tokens: int = 24,
) -> TaskSample:
    """Generate one common-words sample.

    Parameters
    ----------
    tokenizer : TokenizerLike
        Sizes the prompt.
    length : int
        Target tokens of ``context + question`` (met within ~1%).
    depth : float
        Unused (the common words are spread over the whole list); recorded for the grid.
    seed : int
        Word choice and order.
    num_common, freq_common, freq_rare : int
        How many common words, how often each appears, how often every other word appears
        (``freq_common > freq_rare``).
    max_new_tokens : int
        Answer budget.

    Returns
    -------
    TaskSample
        ``answers`` are the common words (score: the fraction named).
    """
    check_tokenizer(tokenizer)
    length = check_length(length)
    depth = check_depth(depth)
    check_count(num_common, "num_common")
    check_count(freq_rare, "freq_rare")
    check_count(freq_common, "freq_common", freq_rare + 1)
    check_count(max_new_tokens, "max_new_tokens")
    rng = random.Random(seed)
    vocab = list(corpus_words())
    rng.shuffle(vocab)
    common, pool = vocab[:num_common], vocab[num_common:]
    question = QUESTION.format(n=num_common)
    fixed = count_tokens(tokenizer, PREAMBLE) + count_tokens(tokenizer, question)
    order_seed = rng.randrange(2**32)

    def build(n_rare: int) -> tuple[str, int]:
        if n_rare > len(pool):
            raise ValueError(f"length={length} needs more distinct words than the corpus has ({len(pool)})")
        words = common * freq_common + [w for w in pool[:n_rare] for _ in range(freq_rare)]
        random.Random(order_seed).shuffle(words)
        context = PREAMBLE + _render(words)
        return context, count_tokens(tokenizer, context + question)

    per_word = max(1, count_tokens(tokenizer, _render(pool[:50])) // 50)
    n_rare = max(0, (length - fixed) // per_word - num_common * freq_common) // freq_rare
    slope = float(per_word * freq_rare)  # tokens per rare word, refined by secant steps on measured lengths
    best = (*build(n_rare), n_rare)
    prev = best
    for _ in range(12):
        _, got, n = prev
        if abs(best[1] - length) <= max(1, length // 200):
            break
        n_next = max(0, n + round((length - got) / slope))
        if n_next == n:
            n_next = n + (1 if length > got else -1)
            if n_next < 0:
                break
        trial = (*build(n_next), n_next)
        if trial[1] != got:
            slope = max(1.0, (trial[1] - got) / (n_next - n))
        prev = trial
        if abs(trial[1] - length) < abs(best[1] - length):
            best = trial
    context, got, n_rare = best
    if got > length * 1.05:
        raise ValueError(f"length={length} is too small for common_words: {num_common * freq_common} common entries")
    return TaskSample(
        context=context,
        question=question,
        answers=list(common),
        max_new_tokens=max_new_tokens,
        task="common_words",
        kind="aggregation",
        length=got,
        target_length=length,
        depth=depth,
        seed=seed,
        info={"common": list(common), "rare_words": n_rare, "freq_common": freq_common, "freq_rare": freq_rare},
    )
