"""The evaluation sample shared by every generated task."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TaskSample:
    """One plain-completion evaluation prompt.

    The prompt fed to the model is ``context + question``. Only ``context`` is compressed (the
    compression is query-agnostic); ``question`` is appended afterwards.

    Parameters
    ----------
    context : str
        Instructions plus haystack with the needle(s) inside.
    question : str
        Text appended after the context; ends where the model should continue.
    answers : list of str
        Strings the prediction must contain; the score is the fraction found.
    max_new_tokens : int
        Generation budget that comfortably covers the answers.
    task : str
        Registry name of the generator (``"passkey"``, ``"niah_single"`` ...).
    kind : str
        What is measured: ``"retrieval"`` (one answer), ``"multi_retrieval"`` (all of several
        values) or ``"tracking"`` (follow assignment chains).
    length : int
        Measured token count of ``context + question`` (no special tokens).
    target_length : int
        Requested token count.
    depth : float
        Requested needle depth in ``[0, 1]``: the fraction of the haystack's non-needle tokens
        that come before the (queried) needle.
    seed : int
        Seed the sample was generated from.
    info : dict
        Task-specific details: ``needles`` (inserted texts), ``needle_offsets`` (their character
        offsets in ``context``), ``haystack_start`` / ``haystack_end`` (character span of the
        haystack in ``context``), ``needle_depths`` (realised token depths) and so on.
    """

    context: str
    question: str
    answers: list[str]
    max_new_tokens: int = 16
    task: str = ""
    kind: str = "retrieval"
    length: int = 0
    target_length: int = 0
    depth: float = 0.5
    seed: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The full prompt, ``context + question``."""
        return self.context + self.question

    @property
    def metadata(self) -> dict[str, Any]:
        """Flat summary for result tables: task, kind, length, target length, depth, seed."""
        return {
            "task": self.task,
            "kind": self.kind,
            "length": self.length,
            "target_length": self.target_length,
            "depth": self.depth,
            "seed": self.seed,
        }
