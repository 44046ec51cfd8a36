"""Registry of task generators and a helper that builds a grid of samples."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvbench.tasks.common_words import common_words
from kvbench.tasks.kv_retrieval import kv_retrieval
from kvbench.tasks.needle import niah_multikey, niah_multivalue, niah_single
from kvbench.tasks.passage_qa import passage_qa
from kvbench.tasks.passkey import passkey
from kvbench.tasks.sample import TaskSample
from kvbench.tasks.tokens import check_count, check_depth, check_length, check_tokenizer
from kvbench.tasks.variable_tracking import variable_tracking
from kvcore.checks import check_int

#: ``name -> generator(tokenizer, length, depth, seed, **options) -> TaskSample``.
TASKS: dict[str, Callable[..., TaskSample]] = {
    "passkey": passkey,
    "niah_single": niah_single,
    "niah_multikey": niah_multikey,
    "niah_multivalue": niah_multivalue,
    "kv_retrieval": kv_retrieval,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "passage_qa": passage_qa,
}


def sample_seed(seed: int, name: str, length: int, depth: float, index: int) -> int:
    """Deterministic per-sample seed derived from the grid coordinates (stable across runs and platforms)."""
    digest = hashlib.sha256(f"{seed}|{name}|{length}|{depth!r}|{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _as_list(value: Any, name: str) -> list:
    if isinstance(value, (str, int, float)):
        return [value]
    if not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a value or an iterable of values, got {type(value).__name__}")
    out = list(value)
    if not out:
        raise ValueError(f"{name} must not be empty")
    return out


def make_tasks(
    names: str | Iterable[str],
    lengths: int | Iterable[int],
    depths: float | Iterable[float],
    n_per: int,
    tokenizer: Any,
    seed: int = 0,
    options: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[TaskSample]:
    """Generate every combination of task, length and depth, ``n_per`` samples each.

    Parameters
    ----------
    names : str or iterable of str
        Keys of :data:`TASKS`.
    lengths : int or iterable of int
        Target prompt lengths in tokens.
    depths : float or iterable of float
        Needle depths in ``[0, 1]``.
    n_per : int
        Samples per (task, length, depth).
    tokenizer : TokenizerLike
        Sizes the prompts.
    seed : int
        Master seed; each sample gets :func:`sample_seed` of its coordinates, so adding tasks,
        lengths or depths to a grid does not change the samples already in it.
    options : mapping, optional
        Per-task keyword options, e.g. ``{"niah_multikey": {"num_keys": 8}}``.

    Returns
    -------
    list of TaskSample
        Ordered by task, length, depth, index.
    """
    names = _as_list(names, "names")
    for n in names:
        if n not in TASKS:
            raise ValueError(f"names: unknown task {n!r}; known tasks: {sorted(TASKS)}")
    lengths = [check_length(x, "lengths") for x in _as_list(lengths, "lengths")]
    depths = [check_depth(x, "depths") for x in _as_list(depths, "depths")]
    check_count(n_per, "n_per")
    check_tokenizer(tokenizer)
    check_int("seed", seed)
    options = dict(options or {})
    for n in options:
        if n not in TASKS:
            raise ValueError(f"options: unknown task {n!r}; known tasks: {sorted(TASKS)}")
    out: list[TaskSample] = []
    for name in names:
        gen = TASKS[name]
        kw = dict(options.get(name, {}))
        for length in lengths:
            for depth in depths:
                for i in range(n_per):
                    out.append(gen(tokenizer, length, depth, sample_seed(seed, name, length, depth, i), **kw))
    return out
