"""Locally generated long-context evaluation tasks (plain-completion prompts).

Every generator returns a :class:`TaskSample` whose ``context`` (instructions + haystack +
needles, the part that is compressed) is followed by a ``question``; :func:`score` gives the
fraction of ``answers`` found in the model's continuation. Lengths are measured with the model's
tokenizer; everything is deterministic given the seed.

Tasks (:data:`TASKS`): ``passkey``, ``niah_single``, ``niah_multikey``, ``niah_multivalue``,
``kv_retrieval``, ``variable_tracking`` and the RULER families ``common_words`` (aggregation) and
``passage_qa`` (a question about one corpus passage among others). Text for perplexity / KL: :func:`lee_background`,
:func:`continuation_split`.
"""

from kvbench.tasks.common_words import common_words
from kvbench.tasks.haystack import BuiltContext, build_context
from kvbench.tasks.kv_retrieval import kv_retrieval
from kvbench.tasks.needle import niah_multikey, niah_multivalue, niah_single
from kvbench.tasks.passage_qa import passage_qa
from kvbench.tasks.passkey import FILLER, passkey
from kvbench.tasks.registry import TASKS, make_tasks, sample_seed
from kvbench.tasks.sample import TaskSample
from kvbench.tasks.scoring import contains_answer, score
from kvbench.tasks.text import CALIBRATION_STORIES, continuation_split, lee_background, lee_sentences
from kvbench.tasks.tokens import TokenizerLike, count_tokens
from kvbench.tasks.variable_tracking import variable_tracking

__all__ = [
    "CALIBRATION_STORIES",
    "FILLER",
    "TASKS",
    "BuiltContext",
    "TaskSample",
    "TokenizerLike",
    "build_context",
    "common_words",
    "contains_answer",
    "continuation_split",
    "count_tokens",
    "kv_retrieval",
    "lee_background",
    "lee_sentences",
    "make_tasks",
    "niah_multikey",
    "niah_multivalue",
    "niah_single",
    "passage_qa",
    "passkey",
    "sample_seed",
    "score",
    "variable_tracking",
]
