"""Key-value retrieval over a JSON object of random UUID pairs (Liu et al. 2023, "Lost in the Middle")."""

from __future__ import annotations

import json
import random
from typing import Any

from kvbench.tasks.haystack import answers_only_in_needles, build_context
from kvbench.tasks.sample import TaskSample
from kvbench.tasks.tokens import check_count, check_depth, check_length, check_tokenizer, count_tokens
from kvbench.tasks.values import random_uuid

PREAMBLE = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{"
SUFFIX = "}"
JOINER = ",\n "
QUESTION = '\n\nKey: "{key}"\nCorresponding value: "'


def _record(key: str, value: str) -> str:
    return f"{json.dumps(key)}: {json.dumps(value)}"


def kv_retrieval(
    tokenizer: Any, length: int, depth: float = 0.5, seed: int = 0, *, max_new_tokens: int = 3
) -> TaskSample:
    """A JSON object of random UUID key/value pairs; ask the value of the pair at ``depth``.

    The question ends with an opening quote, so the continuation should start with the value.

    Parameters
    ----------
    tokenizer : TokenizerLike
        Sizes the prompt.
    length : int
        Target tokens of ``context + question``.
    depth : float
        Fraction of the records (in tokens) before the queried one, in ``[0, 1]``.
    seed : int
        Seed of all keys and values.
    max_new_tokens : int
        Extra generation budget beyond the value's own tokens.

    Returns
    -------
    TaskSample
        ``answers == [value]``.
    """
    check_tokenizer(tokenizer)
    length = check_length(length)
    depth = check_depth(depth)
    check_count(max_new_tokens, "max_new_tokens")
    rng = random.Random(seed)
    for _ in range(20):
        key, value = random_uuid(rng), random_uuid(rng)
        sub = random.Random(rng.getrandbits(64))
        needle = _record(key, value)
        question = QUESTION.format(key=key)
        built = build_context(
            tokenizer,
            length,
            preamble=PREAMBLE,
            question=question,
            units=lambda i: _record(random_uuid(sub), random_uuid(sub)),
            needles=[(depth, needle)],
            joiner=JOINER,
            suffix=SUFFIX,
            partial=False,
            task="kv_retrieval",
        )
        if answers_only_in_needles(built.context, [key, value], [needle]):
            break
    else:  # pragma: no cover - 128-bit collisions
        raise RuntimeError("could not place a unique key")
    return built.sample(
        question=question,
        answers=[value],
        needles=[needle],
        target_length=length,
        depth=depth,
        seed=seed,
        task="kv_retrieval",
        kind="retrieval",
        max_new_tokens=count_tokens(tokenizer, value) + max_new_tokens,
        key=key,
        num_records=built.n_units + 1,
    )
