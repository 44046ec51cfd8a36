import pytest

from kvcore import Scorer, Scores
from kvcore.testing import ScorerTests


class KeyNorm(Scorer):  # keep low-norm keys (Devoto et al. 2024, "A simple and effective L2 norm-based strategy")
    def score(self, ctx):
        return Scores(-ctx.keys.float().norm(dim=-1))


class TestKeyNorm(ScorerTests):
    @pytest.fixture
    def scorer(self):
        return KeyNorm()
