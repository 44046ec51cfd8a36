"""Question answering from one passage of the local corpus, hidden among other passages (RULER's QA family).

RULER (Hsieh et al. 2024, Sec. 3) asks a SQuAD / HotpotQA question about one of many paragraphs. Offline, the
paragraphs are ``lee_background.cor`` sentences: the *gold passage* is three consecutive sentences, the middle one
holding a number; the question quotes that sentence up to the number and asks for it (a cloze question, so it
is scored without a reader model). The other passages are sentences from elsewhere in the corpus; the answer
number occurs nowhere else in the context.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any

from kvbench.tasks.haystack import answers_only_in_needles, build_context
from kvbench.tasks.sample import TaskSample
from kvbench.tasks.text import lee_sentences
from kvbench.tasks.tokens import check_count, check_depth, check_length, check_tokenizer, count_tokens

PREAMBLE = (
    "Answer the question based on the given documents. Only give me the answer.\n\n"
    "The following are given documents.\n\n"
)
QUESTION = (
    "\n\nAnswer the question based on the given documents.\nQuestion: In the documents, which number completes "
    'the sentence "{prefix} ..."?\nAnswer: {prefix}'
)
_NUMBER = re.compile(r"(?<![0-9A-Za-z$.,])([0-9]{2,4})(?![0-9A-Za-z])")


@functools.lru_cache(maxsize=1)
def _candidates() -> tuple[tuple[int, int], ...]:
    """(sentence index, character offset of a number) where the number follows at least 5 words of the sentence."""
    out = []
    sentences = lee_sentences()
    for i in range(1, len(sentences) - 1):
        m = _NUMBER.search(sentences[i])
        if m and len(sentences[i][: m.start()].split()) >= 5:
            out.append((i, m.start()))
    return tuple(out)


def passage_qa(
    tokenizer: Any,
    length: int,
    depth: float = 0.5,
    seed: int = 0,
    *,
    max_new_tokens: int = 6,
) -> TaskSample:
    """Generate one passage-QA sample.

    Parameters
    ----------
    tokenizer : TokenizerLike
        Sizes the prompt.
    length : int
        Target tokens of ``context + question``.
    depth : float
        Where the gold passage sits among the other sentences, in ``[0, 1]``.
    seed : int
        Choice of the gold passage and of the surrounding text.
    max_new_tokens : int
        Answer budget.

    Returns
    -------
    TaskSample
        ``answers == [number]``.
    """
    check_tokenizer(tokenizer)
    length = check_length(length)
    depth = check_depth(depth)
    check_count(max_new_tokens, "max_new_tokens")
    rng = random.Random(seed)
    sentences = lee_sentences()
    cands = _candidates()
    for _ in range(50):
        i, off = cands[rng.randrange(len(cands))]
        gold = " ".join(sentences[i - 1 : i + 2])
        number = _NUMBER.match(sentences[i], off).group(1)
        prefix = sentences[i][:off].rstrip()
        question = QUESTION.format(prefix=prefix)
        start = rng.randrange(len(sentences))

        def unit(k: int, start=start, i=i) -> str:
            j = (start + k) % len(sentences)
            return sentences[(j + 3) % len(sentences)] if abs(j - i) <= 1 else sentences[j]

        built = build_context(
            tokenizer,
            length,
            preamble=PREAMBLE,
            question=question,
            units=unit,
            needles=[(depth, gold)],
            task="passage_qa",
        )
        if answers_only_in_needles(built.context, [number], [gold]) and prefix not in built.context.replace(gold, ""):
            break
    else:  # pragma: no cover - the corpus has many numbered sentences
        raise RuntimeError("could not place a passage whose number occurs once")
    return built.sample(
        question=question,
        answers=[number],
        needles=[gold],
        target_length=length,
        depth=depth,
        seed=seed,
        task="passage_qa",
        kind="qa",
        max_new_tokens=max(max_new_tokens, count_tokens(tokenizer, " " + number) + 2),
        sentence=i,
    )
