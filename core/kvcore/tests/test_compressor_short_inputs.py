"""``Compressor(strict=...)`` on a padded batch where some rows are too short for the budget: with ``strict=False``
only those rows keep exactly their protected entries (and a ``ShortInputWarning`` names them), the other rows keep
their budget; ``strict=True`` raises."""

from __future__ import annotations

import warnings

import pytest
import torch
from kvcore_toys import KeyNorm

from kvcore import Budget, Compressor, DenseStore, Protection, ScoringContext, ShortInputWarning, TopKSelector

LENGTHS = (40, 8, 14)  # real tokens per row, left-padded to 40; row 1 is too short for ratio 0.5 and 2 + 4 protected
PROTECT = Protection(sinks=2, recent=4)


def context(seed: int = 0, lengths=LENGTHS, H: int = 3, D: int = 8) -> ScoringContext:
    T = max(lengths)
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(len(lengths), H, T, D, generator=g), torch.randn(len(lengths), H, T, D, generator=g)
    mask = torch.arange(T)[None, :] >= T - torch.tensor(lengths)[:, None]
    return ScoringContext(keys, values, attention_mask=mask)


def compressor(granularity: str = "head", strict: bool = False, **budget) -> Compressor:
    b = Budget(**(budget or {"ratio": 0.5}), granularity=granularity)
    return Compressor(KeyNorm(), TopKSelector(), DenseStore, b, PROTECT, name="keynorm", strict=strict)


@pytest.mark.parametrize("granularity", ["head", "layer"])
@pytest.mark.parametrize("seed", [0, 1])
def test_only_short_rows_fall_back_to_their_protected_entries(granularity, seed):
    c, ctx = compressor(granularity), context(seed)
    prot = PROTECT.mask(ctx.valid)
    assert c.short_rows(prot, ctx.valid) == [1]
    with pytest.warns(ShortInputWarning, match=r"rows \[1\]"):
        plan = c.plan(ctx)
    H = ctx.num_kv_heads
    keep = plan.keep_keys
    # the short row keeps exactly its protected entries, in every head
    assert torch.equal(keep[1], prot[1][None, :].expand(H, -1))
    for b in (0, 2):  # the others keep their budget, protected entries included, no padding
        n = LENGTHS[b]
        counts = keep[b].sum(-1)
        if granularity == "head":
            assert counts.tolist() == [c.budget.kept(n)] * H
        else:
            assert int(counts.sum()) == c.budget.kept(n) * H
        assert bool(keep[b][:, prot[b]].all()) and not bool(keep[b][:, ~ctx.valid[b]].any())
    # the rows that are not short get the plan they get without the short row
    alone = compressor(granularity).plan(_rows(ctx, [0, 2]))
    assert torch.equal(keep[[0, 2]], alone.keep_keys)


def _rows(ctx: ScoringContext, rows: list[int]) -> ScoringContext:
    return ScoringContext(ctx.keys[rows], ctx.values[rows], attention_mask=ctx.valid[rows])


def test_compress_writes_the_fallback_plan():
    c, ctx = compressor(), context()
    with pytest.warns(ShortInputWarning):
        store = c.compress(ctx)
    lens = store.seq_lengths()
    assert lens[1].tolist() == [int(PROTECT.mask(ctx.valid)[1].sum())] * ctx.num_kv_heads
    assert lens[0].tolist() == [c.budget.kept(LENGTHS[0])] * ctx.num_kv_heads


def test_strict_raises_on_short_rows():
    ctx = context()
    with pytest.raises(ValueError, match="protected"):
        compressor(strict=True).plan(ctx)
    with pytest.raises(ValueError, match="protected"):
        compressor(strict=True).compress(ctx)


def test_no_warning_when_every_row_fits():
    ctx = context(lengths=(40, 20, 14))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortInputWarning)
        plan = compressor().plan(ctx)
        strict = compressor(strict=True).plan(ctx)
    assert torch.equal(plan.key_bits, strict.key_bits)


def test_token_budget_below_the_protected_count():
    c, ctx = compressor(tokens=5), context(lengths=(40, 3, 14))  # 5 < 6 protected for rows 0 and 2; row 1 has 3
    prot = PROTECT.mask(ctx.valid)
    assert c.short_rows(prot, ctx.valid) == [0, 2]
    with pytest.warns(ShortInputWarning, match=r"rows \[0, 2\]"):
        plan = c.plan(ctx)
    for b in (0, 2):
        assert torch.equal(plan.keep_keys[b], prot[b][None, :].expand(ctx.num_kv_heads, -1))
    assert plan.keep_keys[1].sum(-1).tolist() == [3] * ctx.num_kv_heads  # budget 5 of 3 real tokens: all of them


def test_global_budget_short_rows_across_layers():
    c = compressor("global")
    ctxs = [context(seed) for seed in (0, 1)]
    with pytest.warns(ShortInputWarning):
        plans = c.plan_layers(ctxs)
    prot = PROTECT.mask(ctxs[0].valid)
    for plan in plans:
        assert torch.equal(plan.keep_keys[1], prot[1][None, :].expand(ctxs[0].num_kv_heads, -1))
    total = sum(int(p.keep_keys[0].sum()) for p in plans)
    assert total == c.budget.kept(LENGTHS[0]) * ctxs[0].num_kv_heads * len(ctxs)
