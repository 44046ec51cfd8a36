"""``SelectorTests``: exact kept counts per granularity, protected entries kept inside the budget,
ties to the lower index, top-k by score within each head, padding never kept, separate key/value scores, the
average-bits budget of tiered selectors (HqeKV Eq. 3), plans within a declared ``plan_bits`` (``kvcore.PlanBits``), and
clear errors (NaN/inf, protected over budget, types).

Fixture ``selector``. Flags: ``supports_granularities`` (subset of ``("head", "layer", "global")``, default
``("head",)``; "global" selects over ``[L, B, H, T]`` scores), ``supports_token_budget`` (``Budget(tokens=...)``,
default True), ``tiered`` (budgeted by ``avg_bits``; default: the selector declares ``kvcore.TierShares``),
``tiers`` (default the declared ``selector.tiers``), ``avg_bits_choices`` (feasible ``avg_bits``, default the
quartiles of the tier range). Hook ``expected_shares(selector, budget)`` (default the declared
``selector.resolve_shares``; ``None`` skips the share check). Capabilities are read from the declaration
(:func:`kvcore.tier_shares`), never probed: a selector declaring ``tiers`` without ``resolve_shares`` fails with a
``TypeError``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume
from hypothesis import strategies as st

from kvcore.budget import Budget
from kvcore.plan import EVICT, FULL, Plan
from kvcore.protocols import PlanBits
from kvcore.scores import Scores
from kvcore.testing.base import StandardTests, forall
from kvcore.testing.strategies import SEEDS, budgets, budgets_below_protected, fill, left_padded_masks, protections
from kvcore.tier_shares import tier_shares

KINDS = ("normal", "plateau", "constant", "huge")


def heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, T]`` or ``[L, B, H, T]`` -> ``[B, G, T]``: one row per head of each batch row."""
    return x if x.ndim == 3 else x.permute(1, 0, 2, 3).flatten(1, 2)


@st.composite
def cases(draw, granularity: str, kinds=KINDS):
    """``(scores [B, H, T] ([L, B, H, T] for "global") float32, valid [B, T], protection)``."""
    B, H, T = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 48))
    shape = ((draw(st.integers(1, 3)),) if granularity == "global" else ()) + (B, H, T)
    scores = fill(shape, torch.float32, draw(st.sampled_from(kinds)), draw(SEEDS))
    return scores, draw(left_padded_masks(B, T)), draw(protections())


class SelectorTests(StandardTests):
    """Standard tests for a ``kvcore.Selector``."""

    supports_granularities: tuple[str, ...] = ("head",)
    supports_token_budget: bool = True
    tiered: bool | None = None
    tiers: tuple[int, ...] | None = None
    avg_bits_choices: tuple[float, ...] | None = None

    @pytest.fixture
    def selector(self):
        raise NotImplementedError("override the `selector` fixture: return the Selector under test")

    def expected_shares(self, selector, budget: Budget) -> dict[int, float] | None:
        """Share of entries per bit width under ``budget`` (``None``: not checked)."""
        declared = tier_shares(selector)
        return None if declared is None else declared.resolve_shares(budget)

    def is_tiered(self, selector) -> bool:
        """The ``tiered`` flag, or whether the selector declares :class:`kvcore.TierShares`."""
        return bool(self.flag("tiered", tier_shares(selector) is not None))

    def declared_tiers(self, selector) -> tuple[int, ...]:
        """The ``tiers`` flag, or the widths the selector declares (:class:`kvcore.TierShares`)."""
        declared = tier_shares(selector)
        tiers = self.flag("tiers", None if declared is None else declared.tiers)
        if tiers is None:
            raise TypeError(
                f"{type(selector).__name__} is tested as tiered but declares no tiers: set the suite's `tiers` flag "
                "or implement kvcore.TierShares (tiers and resolve_shares)"
            )
        return tuple(tiers)

    def avg_bits(self, selector) -> tuple[float, ...]:
        tiers = self.declared_tiers(selector)
        lo, hi = min(tiers), max(tiers)
        return tuple(self.flag("avg_bits_choices", [lo + (hi - lo) * f for f in (0.25, 0.5, 0.75)]))

    def budget(self, selector, granularity: str, T: int) -> st.SearchStrategy[Budget]:
        if self.is_tiered(selector):
            return st.sampled_from(self.avg_bits(selector)).map(lambda a: Budget(avg_bits=a, granularity=granularity))
        return budgets(T, granularity, self.supports_token_budget)

    def select(self, selector, scores, budget, protected=None, valid=None, values=None) -> Plan:
        """``selector.select``; an example whose protected entries exceed the budget is discarded."""
        tiered = self.is_tiered(selector)
        fits = (
            tiered
            or valid is None
            or protected is None
            or bool((protected.sum(-1) <= torch.tensor([budget.kept(int(n)) for n in valid.sum(-1)])).all())
        )
        assume(fits)
        try:
            plan = selector.select(Scores(scores, values), budget, protected, valid)
        except ValueError as e:
            assume(not (tiered and "protected" in str(e)))
            raise
        assert isinstance(plan, Plan) and tuple(plan.key_bits.shape) == tuple(scores.shape), "plan must match scores"
        if isinstance(selector, PlanBits):  # a declared capability holds: kvcore.Compressor relies on it
            assert plan.tiers() <= selector.plan_bits, (
                f"plan holds tiers {sorted(plan.tiers())} outside the declared plan_bits {sorted(selector.plan_bits)}"
            )
        return plan

    def each(self, selector, check, kinds=KINDS, granularities=None) -> None:
        """``check(granularity, budget, protected, plan, (scores, valid, protection))`` on drawn cases."""

        def run(g, a):
            (scores, valid, protect), data = a
            budget, prot = data.draw(self.budget(selector, g, scores.shape[-1])), protect.mask(valid)
            check(g, budget, prot, self.select(selector, scores, budget, prot, valid), a[0])

        for g in granularities or self.supports_granularities:
            forall(st.tuples(cases(g, kinds), st.data()), lambda a, g=g: run(g, a))

    @pytest.mark.parametrize("granularity", ("head", "layer", "global"))
    def test_kept_count_exact(self, selector, granularity) -> None:
        """Each head (``head``), each layer row (``layer``) or all layers (``global``) keep exactly
        ``budget.kept(n_valid)`` entries per head on average, with the same set for keys and values.

        Troubleshooting: ``ratio`` is the fraction removed and ``kept = floor(n * (1 - ratio))``; count only valid
        (non-padding) tokens; protected entries count inside the budget. List only the granularities you support in
        ``supports_granularities``."""
        self.require(granularity in self.supports_granularities, f"supports_granularities lacks {granularity!r}")
        self.require(not self.is_tiered(selector), "tiered=True (budgeted by avg_bits, not by counts)")

        def check(g, budget, prot, plan, case):
            kept, counts = torch.tensor([budget.kept(int(n)) for n in case[1].sum(-1)]), heads(plan.keep_keys).sum(-1)
            if g == "head":
                assert torch.equal(counts, kept[:, None].expand_as(counts)), f"per-head counts {counts} != {kept}"
            else:
                assert torch.equal(counts.sum(-1), kept * counts.shape[1]), f"{g} counts {counts.sum(-1)} != G*{kept}"
            assert torch.equal(plan.keep_keys, plan.keep_values), "one score tensor must give one kept set"

        self.each(selector, check, granularities=(granularity,))

    def test_ratio_zero_keeps_all_valid(self, selector) -> None:
        """Ratio 0 keeps every valid entry and no padding.

        Troubleshooting: a top-k over padded scores picks padding at ratio 0; mask padding to the lowest score before
        ranking."""
        self.require(not self.is_tiered(selector), "tiered=True (ratio does not budget it)")
        for g in self.supports_granularities:

            def check(case, g=g):
                plan = self.select(selector, case[0], Budget(ratio=0.0, granularity=g), case[2].mask(case[1]), case[1])
                assert torch.equal(heads(plan.keep_keys), case[1][:, None, :].expand_as(heads(plan.keep_keys)))

            forall(cases(g), check, 8)

    def test_protected_always_kept(self, selector) -> None:
        """Protected entries are kept, at the top tier.

        Troubleshooting: force protected entries to the top of the ranking (``+inf`` score after masking), then fill the
        rest of the budget; a tiered selector gives them its highest width."""

        def check(g, budget, prot, plan, case):
            bits, p = heads(plan.key_bits), prot[:, None, :].expand_as(heads(plan.key_bits))
            assert bool((bits[p] > 0).all()), "a protected entry was evicted"
            assert all(int(bits[b][p[b]].min()) == int(bits[b].max()) for b in range(len(p)) if p[b].any()), (
                "protected entries must take the top tier"
            )

        self.each(selector, check)

    def test_padding_never_kept(self, selector) -> None:
        """No padding entry is kept, for keys or values, at any budget.

        Troubleshooting: mask invalid entries out (``-inf``) before ranking and cap the kept count at the number of
        valid tokens of each row."""

        def check(g, budget, prot, plan, case):
            pad = ~case[1][:, None, :].expand_as(heads(plan.keep_keys))
            assert not bool(heads(plan.keep_keys)[pad].any() | heads(plan.keep_values)[pad].any()), "padding kept"

        self.each(selector, check)

    def test_ties_break_by_lower_index(self, selector) -> None:
        """Equal scores favour lower indices, deterministically.

        Troubleshooting: use a stable sort (``torch.sort(..., stable=True, descending=True)``) rather than
        ``torch.topk``, whose tie order is unspecified; mark a deliberate deviation with ``xfail(reason=...)``."""

        def check(g, budget, prot, plan, case):
            free = (case[1] & ~prot)[:, None, :].expand_as(heads(plan.key_bits))
            for b, row in zip(*torch.nonzero(free.any(-1), as_tuple=True)):
                lv = heads(plan.key_bits)[b, row][free[b, row]]
                assert bool((lv[1:] <= lv[:-1]).all()), f"equal scores must favour lower indices, got {lv.tolist()}"
            again = self.select(selector, case[0], budget, prot, case[1])
            assert torch.equal(again.key_bits, plan.key_bits), "the same input gave another plan"

        self.each(selector, check, kinds=("constant",))
        if (
            not self.is_tiered(selector) and "head" in self.supports_granularities
        ):  # one case that always has a tie to break
            scores, valid = torch.ones(1, 2, 8), torch.ones(1, 8, dtype=torch.bool)
            plan = selector.select(Scores(scores), Budget(ratio=0.5, granularity="head"), None, valid)
            kept = plan.key_bits != EVICT
            assert torch.equal(kept, (torch.arange(8) < 4).expand(1, 2, 8)), (
                f"equal scores must keep the lowest indices, kept {kept.int().tolist()}"
            )

    def test_keeps_highest_scores(self, selector) -> None:
        """Among unprotected valid entries, a higher score never gets a lower tier.

        Troubleshooting: rank by score within each head (or layer / all layers for coarser granularities), not
        per batch row; separate key and value scores rank keys and values separately."""

        def check(g, budget, prot, plan, case):
            s, bits = heads(case[0]), heads(plan.key_bits).long()
            free = (case[1] & ~prot)[:, None, :].expand_as(s)
            worse = (s[..., :, None] > s[..., None, :]) & (bits[..., :, None] < bits[..., None, :])
            assert not bool((worse & free[..., :, None] & free[..., None, :]).any()), "a better entry got a lower tier"

        self.each(selector, check)

    def test_separate_value_scores(self, selector) -> None:
        """``Scores(keys, values)`` plans keys from the key scores and values from the value scores.

        Troubleshooting: read ``scores.for_values`` for the value plan and return ``Plan(key_bits, value_bits)``; a
        selector ignoring value scores returns the key plan for both."""

        def check(g, budget, prot, plan, case):
            ks, valid, _ = case
            vs = fill(tuple(ks.shape), torch.float32, "normal", int(ks.abs().sum()) % 1000)
            both = self.select(selector, ks, budget, prot, valid, vs)
            assert torch.equal(both.key_bits, plan.key_bits), "value scores changed the key plan"
            assert torch.equal(both.bits_for_values, self.select(selector, vs, budget, prot, valid).key_bits)

        self.each(selector, check)

    def test_average_bits_budget(self, selector) -> None:
        """Tiered selectors meet ``avg_bits`` (within one top-tier entry per row) and the per-width shares of
        ``expected_shares`` (HqeKV Eq. 3).

        Troubleshooting: solve shares with :func:`kvcore.solve_shares` and turn them into counts with
        :func:`kvcore.tier_counts` (floor rule); assign widths by score rank."""
        self.require(self.is_tiered(selector), "tiered=False")
        declared = tier_shares(selector)
        top = max(self.flag("tiers", (FULL,) if declared is None else declared.tiers))

        def check(g, budget, prot, plan, case):
            plan, a, valid = self.select(selector, case[0], budget, None, case[1]), budget.avg_bits, case[1]
            avg = plan.average_bits(valid)
            assert a - top / int(valid.sum(-1).min()) - 1e-6 <= avg <= a + 1e-6, f"{avg} bits for avg_bits={a}"
            shares = self.expected_shares(selector, budget)
            bits = heads(plan.key_bits).long().masked_fill(~valid[:, None], -1)
            for b in range(bits.shape[0]) if shares else ():  # per head, or per layer ([1, H*T])
                groups = bits[b] if g == "head" else bits[b].flatten()[None]
                n = int(valid[b].sum()) * (1 if g == "head" else bits.shape[1])
                for width, share in shares.items():
                    got = (groups == width).sum(-1).float()
                    assert bool(((got - share * n).abs() < 1 + 1e-6).all()), f"{width}-bit count {got} vs {share}*{n}"

        self.each(selector, check)

    def test_budget_below_protected_raises(self, selector) -> None:
        """A budget that keeps fewer entries than are protected raises a ``ValueError`` mentioning "protected".

        Troubleshooting: compare ``budget.kept(n)`` with the protected count per row before selecting, and raise naming
        both numbers (the Compressor's ``strict=False`` policy handles short inputs above the selector)."""
        for g in self.supports_granularities:

            def check(args, g=g):
                (T, protect, budget), seed = args
                scores = fill(((2,) if g == "global" else ()) + (2, 3, T), seed=seed)
                valid = torch.ones(2, T, dtype=torch.bool)
                prot = protect.mask(valid)
                if self.is_tiered(selector):  # everything protected, but the top tier cannot hold everything
                    prot, budget = valid, Budget(avg_bits=min(self.avg_bits(selector)), granularity=g)
                with pytest.raises(ValueError, match="protected"):
                    selector.select(Scores(scores), budget, prot, valid)

            forall(st.tuples(budgets_below_protected(g, self.supports_token_budget), SEEDS), check, 8)

    def _valid_call(self, selector):
        g = self.supports_granularities[0]
        b = (
            Budget(avg_bits=max(self.avg_bits(selector)), granularity=g)
            if self.is_tiered(selector)
            else Budget(0.5, granularity=g)
        )
        return fill(((2,) if g == "global" else ()) + (2, 3, 10)), b

    @pytest.mark.parametrize("bad", (float("nan"), float("inf"), float("-inf")))
    def test_rejects_nonfinite_scores(self, selector, bad) -> None:
        """NaN or infinite scores raise ``ValueError``.

        Troubleshooting: check scores with :func:`kvcore.checks.check_finite` before masking padding; a NaN would
        otherwise rank arbitrarily."""
        scores, budget = self._valid_call(selector)
        scores.view(-1)[7] = bad
        with pytest.raises(ValueError):
            selector.select(Scores(scores), budget)

    @pytest.mark.parametrize("ratio", (-0.1, 1.0, 1.5, float("nan")))
    def test_rejects_ratio_outside_unit_interval(self, ratio) -> None:
        """``Budget`` refuses ratios outside ``[0, 1)`` and NaN.

        Troubleshooting: this checks kvcore's ``Budget``; a failure here is a kvcore bug, not the selector's."""
        with pytest.raises(ValueError):
            Budget(ratio=ratio)

    def test_rejects_wrong_types(self, selector) -> None:
        """Raw tensors instead of ``Scores``, a float instead of a ``Budget``, and non-bool masks raise
        ``TypeError``.

        Troubleshooting: check argument types at the top of ``select`` (``isinstance(scores, Scores)``, ``Budget``,
        :func:`kvcore.checks.check_bool_mask`)."""
        s, b = self._valid_call(selector)
        int_mask, float_mask = torch.ones(2, 10, dtype=torch.int64), torch.ones(2, 10)
        for args in ((s, b), (Scores(s), 0.5), (Scores(s), b, int_mask), (Scores(s), b, None, float_mask)):
            with pytest.raises(TypeError):
                selector.select(*args)
