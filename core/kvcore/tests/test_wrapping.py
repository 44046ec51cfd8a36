"""WrappingScorer reads what its base reads."""

from dataclasses import dataclass
from typing import ClassVar

import pytest

from kvcore import Scorer, Scores, WrappingScorer


@dataclass(frozen=True)
class Needy(Scorer):
    needs_queries: ClassVar[bool] = True
    query_window: ClassVar[int] = 7
    needs_values: ClassVar[bool] = True
    needs_extras: ClassVar[frozenset[str]] = frozenset({"surprisal"})

    def score(self, ctx):
        return Scores(ctx.keys[..., 0].float())


@dataclass(frozen=True)
class Doubled(WrappingScorer):
    base: Scorer

    def __post_init__(self):
        self.check_base()

    def score(self, ctx):
        return Scores(2 * self.base.score(ctx).keys)


def test_declarations_are_the_base_s():
    w = Doubled(Needy())
    assert (w.needs_queries, w.query_window, w.needs_values, w.needs_extras) == (
        True,
        7,
        True,
        frozenset({"surprisal"}),
    )
    assert w.chunkable is False and isinstance(w, Scorer)
    plain = Doubled(Doubled(Needy()))  # wrappers stack
    assert plain.query_window == 7 and plain.needs_extras == frozenset({"surprisal"})


def test_a_base_that_is_no_scorer_is_refused():
    with pytest.raises(TypeError, match="base must implement kvcore.Scorer, got str"):
        Doubled("snapkv")
