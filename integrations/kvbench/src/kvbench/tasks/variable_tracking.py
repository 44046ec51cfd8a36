"""Variable tracking, RULER style: follow chains ``VAR A = 12345``, ``VAR B = VAR A`` ... in filler."""

from __future__ import annotations

import random
from typing import Any

from kvbench.tasks.haystack import answers_only_in_needles, build_context
from kvbench.tasks.passkey import filler_unit
from kvbench.tasks.sample import TaskSample
from kvbench.tasks.tokens import check_count, check_depth, check_length, check_tokenizer, count_tokens
from kvbench.tasks.values import random_number, random_var_name, unique

PREAMBLE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
QUESTION = (
    "\nQuestion: Find all variables that are assigned the value {value} in the text above. "
    "Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
    "assigned the value {value}, they are:"
)


def variable_tracking(
    tokenizer: Any,
    length: int,
    depth: float = 0.0,
    seed: int = 0,
    *,
    num_hops: int = 4,
    num_chains: int = 1,
    digits: int = 5,
    max_new_tokens: int = 8,
) -> TaskSample:
    """Chains of variable assignments in filler; ask every variable holding the queried value.

    The queried chain is ``VAR X0 = v``, ``VAR X1 = VAR X0`` ... ``VAR Xh = VAR X(h-1)``; its first
    statement sits at ``depth`` and the later ones evenly between there and the end of the haystack.
    Further (distractor) chains have other values and sit at seeded random depths.

    Parameters
    ----------
    tokenizer : TokenizerLike
        Sizes the prompt.
    length : int
        Target tokens of ``context + question``.
    depth : float
        Depth of the chain's first statement, in ``[0, 1]``.
    seed : int
        Seed of names, values and distractor depths.
    num_hops : int
        Assignments after the first (``num_hops + 1`` variables per chain).
    num_chains : int
        Chains in total (the first is queried).
    digits : int
        Digits of the values.
    max_new_tokens : int
        Minimum generation budget (raised to cover every name).

    Returns
    -------
    TaskSample
        ``answers`` are the variable names; ``score`` is the fraction named.
    """
    check_tokenizer(tokenizer)
    length = check_length(length)
    depth = check_depth(depth)
    check_count(num_hops, "num_hops", 0)
    check_count(num_chains, "num_chains")
    check_count(digits, "digits", 2)
    check_count(max_new_tokens, "max_new_tokens")
    rng = random.Random(seed)
    n_vars = num_hops + 1
    for _ in range(20):
        names = unique(random_var_name, rng, n_vars * num_chains, exclude={"VAR"})
        values = unique(lambda r: random_number(r, digits), rng, num_chains)
        chains = []
        for c in range(num_chains):
            vs = names[c * n_vars : (c + 1) * n_vars]
            chain = [f"VAR {vs[0]} = {values[c]}."]
            chain += [f"VAR {vs[i]} = VAR {vs[i - 1]}." for i in range(1, n_vars)]
            chains.append(chain)
        needles = [(depth + (1.0 - depth) * i / n_vars, s) for i, s in enumerate(chains[0])]
        for chain in chains[1:]:
            ds = sorted(rng.random() for _ in chain)
            needles += list(zip(ds, chain))
        answers = names[:n_vars]
        question = QUESTION.format(value=values[0], n=n_vars)
        built = build_context(
            tokenizer,
            length,
            preamble=PREAMBLE,
            question=question,
            units=filler_unit,
            needles=needles,
            task="variable_tracking",
        )
        texts = [t for _, t in needles]
        if answers_only_in_needles(built.context, names + values, texts):
            break
    else:  # pragma: no cover
        raise RuntimeError("could not place unique variable chains")
    per_name = max(count_tokens(tokenizer, " " + n) for n in answers) + 1
    return built.sample(
        question=question,
        answers=answers,
        needles=texts,
        target_length=length,
        depth=depth,
        seed=seed,
        task="variable_tracking",
        kind="tracking",
        max_new_tokens=max(max_new_tokens, per_name * n_vars + 4),
        value=values[0],
    )
