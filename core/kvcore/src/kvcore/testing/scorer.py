"""``ScorerTests``: float32 finite ``[B, Hkv, T]`` scores for any float dtype, GQA group, padded
batch and degenerate values; deterministic; pure (the context is not mutated); malformed contexts raise.

Fixture ``scorer``. Flags: ``requires_queries`` (default ``scorer.needs_queries``), ``stochastic`` (False: equal
scores under any global torch seed; True: under the same seed). Hook ``make_extras(shapes)`` supplies what
``scorer.needs_extras`` declares.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import strategies as st

from kvcore.context import ScoringContext
from kvcore.scores import Scores
from kvcore.testing.base import ContextTests, forall
from kvcore.testing.strategies import DTYPES, SEEDS, kv_samples


def _tensors(ctx: ScoringContext) -> dict[str, torch.Tensor]:
    out = {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}
    out |= {f"extras[{k}]": v for k, v in ctx.extras.items()}
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


class ScorerTests(ContextTests):
    """Standard tests for a ``kvcore.Scorer``."""

    requires_queries: bool | None = None
    stochastic: bool = False

    @pytest.fixture
    def scorer(self):
        raise NotImplementedError("override the `scorer` fixture: return the Scorer under test")

    def ctx(self, scorer, x, **kw) -> ScoringContext:
        return self.make_context(scorer, x, bool(self.flag("requires_queries", scorer.needs_queries)), **kw)

    def check_scores(self, scorer, ctx: ScoringContext) -> Scores:
        s = scorer.score(ctx)
        assert isinstance(s, Scores), f"score() must return kvcore.Scores, got {type(s).__name__}"
        shape = (ctx.batch_size, ctx.num_kv_heads, ctx.seq_len)
        for t in (s.keys, s.for_values):
            assert tuple(t.shape) == shape and t.dtype == torch.float32, f"want float32 {shape}: {t.dtype} {t.shape}"
            assert bool(torch.isfinite(t).all()), "scores must be finite (padding included)"
        return s

    def test_scores_float32_finite_kv_head_shape(self, scorer) -> None:
        """Scores are float32, finite and ``[B, Hkv, T]`` over drawn shapes, dtypes, GQA groups and padding.

        Troubleshooting: compute in float32 (``.float()`` first), reduce over the GQA group so the result is per KV
        head (never ``repeat_kv`` the keys), and give padding a finite score (the selector masks it) instead of
        ``-inf``."""
        forall(kv_samples(), lambda x: self.check_scores(scorer, self.ctx(scorer, x)))

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_supports_dtype(self, scorer, dtype) -> None:
        """The scorer accepts fp32, fp16 and bf16 contexts.

        Troubleshooting: a dtype error (``expected scalar type``) means mixed dtypes in a matmul; cast inputs to float32
        inside the scorer."""
        forall(kv_samples(dtype=dtype, kinds=("normal",)), lambda x: self.check_scores(scorer, self.ctx(scorer, x)), 8)

    @pytest.mark.parametrize("kind", ("constant", "plateau", "huge", "tiny"))
    def test_degenerate_values(self, scorer, kind) -> None:
        """Constant, plateau (ties), huge and tiny inputs still give finite scores.

        Troubleshooting: normalisations divide by a zero variance or norm (add an epsilon), softmaxes overflow on huge
        logits (subtract the max), and fp16 products overflow (compute in float32)."""
        forall(kv_samples(kinds=(kind,)), lambda x: self.check_scores(scorer, self.ctx(scorer, x)), 8)

    @pytest.mark.parametrize("group", (1, 2, 4))
    def test_gqa_groups(self, scorer, group) -> None:
        """Queries with GQA groups 1, 2 and 4 give ``[B, Hkv, T]`` scores.

        Troubleshooting: reshape queries to ``[B, Hkv, group, W, D]`` and reduce over the group; query head ``j``
        belongs to KV head ``j // group``."""
        self.require(self.flag("requires_queries", scorer.needs_queries), "requires_queries=False (no query window)")
        forall(kv_samples(groups=(group,)), lambda x: self.check_scores(scorer, self.ctx(scorer, x)), 8)

    def test_deterministic(self, scorer) -> None:
        """The same context gives identical scores under any global torch seed (``stochastic = False``), or under
        the same seed (``stochastic = True``).

        Troubleshooting: draw randomness from a ``torch.Generator`` seeded from the context (or the config), not the
        global RNG; avoid non-deterministic reductions; set ``stochastic = True`` for scorers random by design."""

        def check(args):
            ctx, seed = self.ctx(scorer, args[0]), args[1]
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                a = self.check_scores(scorer, ctx)
                torch.manual_seed(seed if self.stochastic else seed + 1)
                b = self.check_scores(scorer, ctx)
            assert torch.equal(a.keys, b.keys) and torch.equal(a.for_values, b.for_values), "same context, other scores"

        forall(st.tuples(kv_samples(), SEEDS), check)

    def test_pure(self, scorer) -> None:
        """``score`` does not mutate the context (keys, values, queries, masks, extras).

        Troubleshooting: replace in-place ops on context tensors (``mul_``, ``masked_fill_``, ``+=``) by out-of-place
        ones, or clone first."""

        def check(x):
            ctx = self.ctx(scorer, x, protected=x.keys[:, 0, :, 0] > 0)
            before = {k: v.clone() for k, v in _tensors(ctx).items()}
            self.check_scores(scorer, ctx)
            assert [k for k, v in _tensors(ctx).items() if not torch.equal(v, before[k])] == [], "score() mutated ctx"

        forall(kv_samples(), check)

    def test_rejects_malformed_context(self, scorer) -> None:
        """Rank-3 keys, ``T == 0``, values with other heads, integer keys and ``Hq`` not a multiple of ``Hkv``
        raise ``ValueError``/``TypeError``.

        Troubleshooting: most of these are caught by ``ScoringContext``; a scorer that builds contexts itself or reads
        raw tensors must validate with :mod:`kvcore.checks`."""
        x, q = torch.randn(2, 2, 6, 8), torch.randn(2, 4, 3, 8)
        shapes = dict(B=2, Hkv=2, Hq=4, T=6, W=3, D=8, dtype=torch.float32, seed=0)
        ex = self.make_extras(shapes) if scorer.needs_extras else {}
        bad = {
            "keys of rank 3": dict(keys=x[0], values=x[0]),
            "T == 0": dict(keys=x[:, :, :0], values=x[:, :, :0]),
            "values with other heads": dict(values=torch.randn(2, 3, 6, 8)),
            "integer keys": dict(keys=x.int()),
            "Hq not a multiple of Hkv": dict(queries=q[:, :3]),
        }
        for what, change in bad.items():
            with pytest.raises((ValueError, TypeError)):
                scorer.score(ScoringContext(**{"keys": x, "values": x, "queries": q, "extras": ex, **change}))
                pytest.fail(f"no error for {what}")

    def test_missing_queries_raise(self, scorer) -> None:
        """A scorer that needs queries raises ``ValueError``/``TypeError`` on a context without them.

        Troubleshooting: check ``ctx.queries is None`` first and raise naming ``queries`` instead of failing with an
        ``AttributeError`` deep inside; declare ``needs_queries = True``."""
        self.require(self.flag("requires_queries", scorer.needs_queries), "requires_queries=False")

        def check(x):
            with pytest.raises((ValueError, TypeError)):
                scorer.score(self.make_context(scorer, x, queries=False))

        forall(kv_samples(), check, 5)

    def test_missing_extras_raise(self, scorer) -> None:
        """A scorer that needs extras raises naming the missing extra.

        Troubleshooting: look the extra up with ``ctx.extras.get(name)`` and raise ``ValueError(f"... needs
        ctx.extras[{name!r}] ...")``; a ``KeyError`` does not tell the user what to supply."""
        self.require(scorer.needs_extras, "scorer.needs_extras is empty")

        def check(x):
            with pytest.raises((ValueError, TypeError)) as err:
                scorer.score(self.ctx(scorer, x, extras=False))
            assert any(name in str(err.value) for name in scorer.needs_extras), "the error must name the missing extra"

        forall(kv_samples(), check, 5)
