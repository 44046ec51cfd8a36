"""``SelectorTests``: the Selector contract (DESIGN.md §3) — exact kept counts per granularity, protected
entries kept inside the budget, ties to the lower index, top-k by score, padding never kept, separate key and
value scores, exact average bits for tiered selectors, clear errors.

Adopt::

    class TestMySelector(SelectorTests):
        supports_granularities = ("head", "layer")

        @pytest.fixture
        def selector(self):
            return MySelector()

Fixture ``selector``. Flags: ``supports_granularities`` (subset of ``("head", "layer", "global")``, default
``("head",)``; "global" takes ``[L, B, H, T]`` scores), ``supports_token_budget`` (``Budget(tokens=...)``,
default True), ``tiered`` (assigns bit widths from ``budget.avg_bits``; default False), ``tiers`` (default
``selector.tiers``), ``avg_bits_choices`` (feasible ``avg_bits``; default quartiles of the tier range). Hook
``expected_shares(selector, budget)`` (default ``selector.resolve_shares``) for the share test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume
from hypothesis import strategies as st

from kvcore.budget import Budget
from kvcore.plan import Plan
from kvcore.protection import Protection
from kvcore.scores import Scores
from kvcore.testing.base import StandardTests, forall
from kvcore.testing.strategies import SEEDS, budgets, budgets_below_protected, fill, left_padded_masks, protections


def heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T]`` or ``[L, B, H, T]`` -> ``[B, G, T]`` (one row per head of the batch row)."""
    return x if x.ndim == 3 else x.permute(1, 0, 2, 3).flatten(1, 2)


@st.composite
def cases(draw, granularity: str, kinds=("normal", "plateau", "constant", "huge")):
    """``(scores [B, H, T] or [L, B, H, T] float32, valid [B, T], protection)``."""
    B, H, T = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 48))
    shape = ((draw(st.integers(1, 3)),) if granularity == "global" else ()) + (B, H, T)
    scores = fill(shape, torch.float32, draw(st.sampled_from(kinds)), draw(SEEDS))
    return scores, draw(left_padded_masks(B, T)), draw(protections())


class SelectorTests(StandardTests):
    """Standard tests for a ``kvcore.Selector``."""

    supports_granularities: tuple[str, ...] = ("head",)
    supports_token_budget: bool = True
    tiered: bool = False
    tiers: tuple[int, ...] | None = None
    avg_bits_choices: tuple[float, ...] | None = None

    @pytest.fixture
    def selector(self):
        raise NotImplementedError("override the `selector` fixture: return the Selector under test")

    def expected_shares(self, selector, budget: Budget) -> dict[int, float] | None:
        """Share of entries per bit width the selector must give under ``budget`` (``None``: not checked)."""
        return selector.resolve_shares(budget) if hasattr(selector, "resolve_shares") else None

    # -- helpers ---------------------------------------------------------------------------------------
    def _tiers(self, selector) -> tuple[int, ...]:
        return tuple(self.flag("tiers", getattr(selector, "tiers", None)))

    def _avg_choices(self, selector) -> tuple[float, ...]:
        lo, hi = min(self._tiers(selector)), max(self._tiers(selector))
        return tuple(self.flag("avg_bits_choices", tuple(lo + (hi - lo) * f for f in (0.25, 0.5, 0.75))))

    def _budget(self, selector, granularity: str, T: int):
        if self.tiered:
            return st.sampled_from(self._avg_choices(selector)).map(lambda a: Budget(avg_bits=a, granularity=granularity))
        return budgets(T, granularity, self.supports_token_budget)

    def _plan(self, selector, scores, budget, protected, valid, values=None) -> Plan:
        plan = selector.select(Scores(scores, values), budget, protected, valid)
        assert isinstance(plan, Plan) and tuple(plan.key_bits.shape) == tuple(scores.shape), "plan must match scores"
        return plan

    def _fitting(self, selector, granularity, case, data):
        """Budget and plan for ``case`` when its protected entries fit (hypothesis skips the example otherwise)."""
        scores, valid, protect = case
        budget, prot = data.draw(self._budget(selector, granularity, scores.shape[-1])), protect.mask(valid)
        if not self.tiered:
            assume(bool((prot.sum(-1) <= torch.tensor([budget.kept(int(n)) for n in valid.sum(-1)])).all()))
            return budget, prot, self._plan(selector, scores, budget, prot, valid)
        try:
            return budget, prot, self._plan(selector, scores, budget, prot, valid)
        except ValueError as e:
            assume("protected" not in str(e))
            raise

    def _each(self, selector, check, kinds=("normal", "plateau", "constant", "huge")) -> None:
        for g in self.supports_granularities:
            forall(st.tuples(cases(g, kinds), st.data()), lambda a, g=g: check(g, *self._fitting(selector, g, *a), a[0]))

    # -- kept counts -----------------------------------------------------------------------------------
    @pytest.mark.parametrize("granularity", ("head", "layer", "global"))
    def test_kept_count_exact(self, selector, granularity) -> None:
        self.require(granularity in self.supports_granularities, f"supports_granularities={self.supports_granularities} lacks {granularity!r}")
        self.require(not self.tiered, "tiered=True (budgeted by avg_bits, not by counts)")

        def check(g, budget, prot, plan, case):
            scores, valid, _ = case
            kept = torch.tensor([budget.kept(int(n)) for n in valid.sum(-1)])
            counts = heads(plan.keep_keys).sum(-1)  # [B, G]
            if g == "head":
                assert torch.equal(counts, kept[:, None].expand_as(counts)), f"per-head counts {counts} != {kept}"
            else:
                assert torch.equal(counts.sum(-1), kept * counts.shape[1]), f"{g} counts {counts.sum(-1)} != G*{kept}"
            assert torch.equal(plan.keep_keys, plan.keep_values), "one score tensor must give one kept set"

        forall(st.tuples(cases(granularity), st.data()), lambda a: check(granularity, *self._fitting(selector, granularity, *a), a[0]))

    def test_ratio_zero_keeps_all_valid(self, selector) -> None:
        self.require(not self.tiered, "tiered=True (ratio does not budget it)")
        for g in self.supports_granularities:
            def check(case, g=g):
                scores, valid, protect = case
                plan = self._plan(selector, scores, Budget(ratio=0.0, granularity=g), protect.mask(valid), valid)
                assert torch.equal(heads(plan.keep_keys), valid[:, None, :].expand_as(heads(plan.keep_keys)))
            forall(cases(g), check, 8)

    def test_protected_always_kept(self, selector) -> None:
        def check(g, budget, prot, plan, case):
            keep, bits = heads(plan.keep_keys), heads(plan.key_bits)
            assert bool(keep[prot[:, None, :].expand_as(keep)].all()), "a protected entry was evicted"
            p = prot[:, None, :].expand_as(bits)
            for b, row in enumerate(bits):  # protected entries take the highest width their group uses
                if p[b].any():
                    assert int(row[p[b]].min()) == int(row.max()), "protected entries must take the top tier"

        self._each(selector, check)

    def test_padding_never_kept(self, selector) -> None:
        def check(g, budget, prot, plan, case):
            pad = ~case[1][:, None, :].expand_as(heads(plan.keep_keys))
            assert not bool(heads(plan.keep_keys)[pad].any()) and not bool(heads(plan.keep_values)[pad].any())

        self._each(selector, check)

    def test_ties_break_by_lower_index(self, selector) -> None:
        def check(g, budget, prot, plan, case):
            free = (case[1] & ~prot)[:, None, :].expand_as(heads(plan.key_bits))
            bits = heads(plan.key_bits).long().masked_fill(~free, -1)
            for b, row in zip(*torch.nonzero(free.any(-1), as_tuple=True)):
                lv = bits[b, row][free[b, row]]
                assert bool((lv[1:] <= lv[:-1]).all()), f"equal scores must favour lower indices, got {lv.tolist()}"
            again = self._plan(selector, case[0], budget, prot, case[1])
            assert torch.equal(again.key_bits, plan.key_bits), "the same input gave another plan"

        self._each(selector, check, kinds=("constant",))

    def test_keeps_highest_scores(self, selector) -> None:
        def check(g, budget, prot, plan, case):
            s, bits = heads(case[0]), heads(plan.key_bits).long()
            free = (case[1] & ~prot)[:, None, :].expand_as(s)
            higher = (s[..., :, None] > s[..., None, :]) & free[..., :, None] & free[..., None, :]
            worse = higher & (bits[..., :, None] < bits[..., None, :])
            assert not bool(worse.any()), "an entry got a lower tier than a lower-scored entry of its head"

        self._each(selector, check)

    def test_separate_value_scores(self, selector) -> None:
        g = self.supports_granularities[0]

        def check(args):
            (ks, valid, protect), seed, data = args
            budget, prot = data.draw(self._budget(selector, g, ks.shape[-1])), protect.mask(valid)
            vs = fill(tuple(ks.shape), torch.float32, "normal", seed)
            try:
                both = self._plan(selector, ks, budget, prot, valid, vs)
            except ValueError as e:
                assume("protected" not in str(e))
                raise
            assert torch.equal(both.key_bits, self._plan(selector, ks, budget, prot, valid).key_bits)
            assert torch.equal(both.bits_for_values, self._plan(selector, vs, budget, prot, valid).key_bits)

        forall(st.tuples(cases(g), SEEDS, st.data()), check)

    # -- tiered ----------------------------------------------------------------------------------------
    def test_average_bits_budget(self, selector) -> None:
        self.require(self.tiered, "tiered=False")
        top = max(self._tiers(selector))
        for g in self.supports_granularities:
            def check(args, g=g):
                (scores, valid, _), a = args
                plan = self._plan(selector, scores, Budget(avg_bits=a, granularity=g), None, valid)
                avg, n = plan.average_bits(valid), int(valid.sum(-1).min())
                assert a - top / n - 1e-6 <= avg <= a + 1e-6, f"average bits {avg} for avg_bits={a} (n={n})"
            forall(st.tuples(cases(g), st.sampled_from(self._avg_choices(selector))), check)

    def test_shares_honoured(self, selector) -> None:
        self.require(self.tiered, "tiered=False")
        for g in self.supports_granularities:
            def check(args, g=g):
                (scores, valid, _), a = args
                budget = Budget(avg_bits=a, granularity=g)
                shares = self.expected_shares(selector, budget)
                if shares is None:
                    pytest.skip("expected_shares() returned None")
                bits = heads(self._plan(selector, scores, budget, None, valid).key_bits).long().masked_fill(~valid[:, None], -1)
                for b in range(bits.shape[0]):
                    groups = bits[b] if g == "head" else bits[b].flatten()[None]
                    n = int(valid[b].sum()) * (1 if g == "head" else bits.shape[1])
                    for width, share in shares.items():
                        got = (groups == width).sum(-1).float()
                        assert bool(((got - share * n).abs() < 1 + 1e-6).all()), f"{width}-bit count {got} vs {share}*{n}"
            forall(st.tuples(cases(g), st.sampled_from(self._avg_choices(selector))), check)

    # -- errors ----------------------------------------------------------------------------------------
    def test_budget_below_protected_raises(self, selector) -> None:
        for g in self.supports_granularities:
            def check(args, g=g):
                (T, protect, budget), seed = args
                lead = (2,) if g == "global" else ()
                scores, valid = fill((*lead, 2, 3, T), torch.float32, "normal", seed), torch.ones(2, T, dtype=torch.bool)
                prot = protect.mask(valid)
                if self.tiered:
                    prot, budget = valid, Budget(avg_bits=min(self._avg_choices(selector)), granularity=g)
                with pytest.raises(ValueError, match="protected"):
                    selector.select(Scores(scores), budget, prot, valid)
            forall(st.tuples(budgets_below_protected(g, self.supports_token_budget), SEEDS), check, 8)

    @pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
    def test_rejects_nonfinite_scores(self, selector, bad) -> None:
        g = self.supports_granularities[0]
        budget = Budget(avg_bits=max(self._avg_choices(selector)), granularity=g) if self.tiered else Budget(0.5, granularity=g)
        scores = fill(((2,) if g == "global" else ()) + (2, 3, 10))
        scores.view(-1)[7] = bad
        with pytest.raises(ValueError):
            selector.select(Scores(scores), budget)

    @pytest.mark.parametrize("ratio", (-0.1, 1.0, 1.5, float("nan")))
    def test_rejects_ratio_outside_unit_interval(self, ratio) -> None:
        with pytest.raises(ValueError):
            Budget(ratio=ratio)

    def test_rejects_wrong_types(self, selector) -> None:
        g = self.supports_granularities[0]
        budget = Budget(avg_bits=max(self._avg_choices(selector)), granularity=g) if self.tiered else Budget(0.5, granularity=g)
        scores = fill(((2,) if g == "global" else ()) + (2, 3, 10))
        for args in ((scores, budget), (Scores(scores), 0.5), (Scores(scores), budget, torch.ones(2, 10, dtype=torch.int64)),
                     (Scores(scores), budget, None, torch.ones(2, 10))):
            with pytest.raises(TypeError):
                selector.select(*args)
