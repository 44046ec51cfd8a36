"""kvcore.replan: re-scoring the entries a Store holds and re-tiering them in place."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from kvcore_toys import KeyNorm, WindowAttention

from kvcore import (
    EVICT,
    FULL,
    Budget,
    Compressor,
    DenseStore,
    KVView,
    Plan,
    Protection,
    Scorer,
    Scores,
    ScoringContext,
    TopKSelector,
    cap_plan,
    replan,
    retier_store,
)

B, H, T, D = 2, 2, 12, 8


def _compressor(scorer=None, ratio: float = 0.5, granularity: str = "head", **kw) -> Compressor:
    return Compressor(
        scorer or KeyNorm(), TopKSelector(), DenseStore, Budget(ratio=ratio, granularity=granularity), **kw
    )


def _kv(seed: int = 0, b: int = B, t: int = T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, H, t, D, generator=g)
    values = torch.randn(b, H, t, D, generator=g)
    positions = torch.arange(t).expand(b, t).clone()
    return keys, values, positions


def _ragged_store(seed: int = 0) -> DenseStore:
    """A store after per-head eviction (heads hold different tokens) plus two appended decode tokens."""
    keys, values, positions = _kv(seed)
    store = DenseStore(growth=4)
    store.write(keys, values, _compressor(ratio=0.5).plan(ScoringContext(keys, values, positions=positions)), positions)
    k2, v2, _ = _kv(seed + 1, t=2)
    store.append(k2, v2, torch.tensor([[T, T + 1]] * B))
    view = store.read()
    assert not bool((view.positions == view.positions[:, :1]).all())  # ragged per head
    return store


def _independent_per_head_keep(view: KVView, n_keep: int, protect_before: int | None = None) -> torch.Tensor:
    """Keep the ``n_keep`` lowest-norm held entries of every (row, head), protected ones first; ``[B, H, T]``."""
    keep = torch.zeros(view.positions.shape, dtype=torch.bool)
    for b in range(view.keys.shape[0]):
        for h in range(view.keys.shape[1]):
            held = (view.positions[b, h] >= 0).nonzero().squeeze(-1).tolist()
            prot = [i for i in held if protect_before is not None and int(view.positions[b, h, i]) < protect_before]
            rest = sorted(set(held) - set(prot), key=lambda i: (float(view.keys[b, h, i].norm()), i))
            for i in (prot + rest)[:n_keep]:
                keep[b, h, i] = True
    return keep


def test_uniform_layout_plan_is_the_selection_of_one_context():
    keys, values, positions = _kv(1)
    store = DenseStore()
    store.append(keys, values, positions)
    comp = _compressor(ratio=0.25)
    plan = replan(store, comp)
    expect = comp.plan(ScoringContext(keys, values, positions=positions))
    assert torch.equal(plan.key_bits, expect.key_bits)
    assert torch.equal(plan.keep_keys, _independent_per_head_keep(store.read(), Budget(ratio=0.25).kept(T)))


def test_uniform_layout_with_layer_granularity_is_exact_per_layer():
    keys, values, positions = _kv(2)
    store = DenseStore()
    store.append(keys, values, positions)
    plan = replan(store, _compressor(ratio=0.5, granularity="layer"))
    assert plan.keep_keys.sum((1, 2)).tolist() == [H * Budget(ratio=0.5).kept(T)] * B


def test_ragged_layout_plan_equals_independent_per_head_selection():
    store = _ragged_store(3)
    view = store.read()
    plan = replan(store, _compressor(ratio=0.5).with_budget(ratio=None, tokens=4))
    assert tuple(plan.key_bits.shape) == tuple(view.positions.shape)  # laid out like read()
    assert torch.equal(plan.keep_keys, _independent_per_head_keep(view, 4))
    assert not bool((plan.keep_keys & ~view.valid).any())  # padding stays EVICT


def test_ragged_per_head_contexts_see_exact_valid_masks_and_their_queries():
    seen = []

    @dataclass(frozen=True)
    class Spy(Scorer):
        needs_queries: ClassVar[bool] = True

        def score(self, ctx):
            seen.append(ctx)
            return WindowAttention().score(ctx)

    store = _ragged_store(4)
    queries = torch.randn(B, 2 * H, 3, D)
    replan(store, _compressor(Spy(), ratio=0.5), queries=queries)
    view = store.read()
    assert len(seen) == H
    for h, ctx in enumerate(seen):
        assert ctx.num_kv_heads == 1
        assert torch.equal(ctx.queries, queries[:, 2 * h : 2 * h + 2])
        assert ctx.valid.sum(-1).tolist() == store.seq_lengths()[:, h].tolist()
        held = view.positions[:, h]
        for b in range(B):
            n = int((held[b] >= 0).sum())
            assert ctx.positions[b, :n].tolist() == sorted(held[b, held[b] >= 0].tolist())


def test_plan_is_laid_out_like_read_even_when_read_is_not_sorted():
    """A store whose read() lists entries in reverse position order gets its plan in that same order."""

    class Reversed(DenseStore):
        def read(self, query=None):
            v = super().read(query)

            def flip(x):
                return x.flip(2)

            return KVView(flip(v.keys), flip(v.values), flip(v.positions), flip(v.logit_bias))

        def tiers(self):
            return Plan(torch.where(self.read().valid, FULL, EVICT).to(torch.uint8))

    keys, values, positions = _kv(5)
    store = Reversed()
    store.append(keys, values, positions)
    plan = replan(store, _compressor(ratio=0.5))
    expect = _compressor(ratio=0.5).plan(ScoringContext(keys, values, positions=positions))
    assert torch.equal(plan.key_bits, expect.key_bits.flip(-1))


def test_retier_store_keeps_surviving_entries_bit_identical():
    store = _ragged_store(6)
    before = store.read()
    before = KVView(*(t.clone() for t in (before.keys, before.values, before.positions, before.logit_bias)))
    plan = retier_store(store, _compressor().with_budget(ratio=None, tokens=3))
    after = store.read()
    assert store.seq_lengths().tolist() == [[3] * H] * B
    for b in range(B):
        for h in range(H):
            keep = plan.keep_keys[b, h]
            assert torch.equal(after.positions[b, h], before.positions[b, h][keep])
            assert torch.equal(after.keys[b, h], before.keys[b, h][keep])
            assert torch.equal(after.values[b, h], before.values[b, h][keep])


def test_protect_before_is_always_kept():
    store = _ragged_store(7)
    held_before = store.read()
    low = (held_before.positions >= 0) & (held_before.positions < 3)
    assert int(low.sum()) > 0
    plan = retier_store(store, _compressor().with_budget(ratio=None, tokens=4), protect_before=3)
    assert bool(plan.keep_keys[low].all())
    assert torch.equal(plan.keep_keys, _independent_per_head_keep(held_before, 4, protect_before=3))
    after = store.read()
    for b in range(B):
        for h in range(H):
            want = set(held_before.positions[b, h][low[b, h]].tolist())
            assert want <= set(after.positions[b, h].tolist())


def test_protection_of_the_compressor_applies_per_head():
    store = _ragged_store(8)
    view = store.read()
    plan = replan(store, _compressor(protect=Protection(recent=2)).with_budget(ratio=None, tokens=3))
    newest = view.positions >= T  # the two appended tokens are each head's most recent entries
    assert bool(plan.keep_keys[newest].all())


class _Tiered(DenseStore):
    """A DenseStore that reports some held entries at 4 bits (a stand-in for a quantized store's tiers)."""

    supported_bits = frozenset({EVICT, 4, FULL})
    can_demote = True

    def tiers(self):
        view = self.read()
        bits = torch.where(view.valid, FULL, EVICT)
        bits = torch.where(view.valid & (view.positions % 2 == 1), 4, bits)
        return Plan(bits.to(torch.uint8))

    def retier(self, plan):
        self.applied = plan
        super().retier(Plan.from_keep(plan.keep_keys))


def test_new_tier_is_never_above_the_held_tier():
    keys, values, positions = _kv(9)
    store = _Tiered()
    store.append(keys, values, positions)
    plan = retier_store(store, _compressor(ratio=0.5))
    expect = _compressor(ratio=0.5).plan(ScoringContext(keys, values, positions=positions)).key_bits
    odd = (positions % 2 == 1)[:, None, :].expand(B, H, T)
    want = torch.where(odd & (expect == FULL), 4, expect).to(torch.uint8)
    assert torch.equal(plan.key_bits, want)
    assert store.applied is plan


def test_cap_plan_with_the_held_tiers_given_equals_asking_the_store():
    """``cap_plan(..., held=store.tiers())`` caps exactly as ``cap_plan`` finding them itself; a ``held`` that is not
    a Plan laid out like the new tiers is refused."""
    keys, values, positions = _kv(11)
    store = _Tiered()
    store.append(keys, values, positions)
    g = torch.Generator().manual_seed(3)
    kb = torch.tensor([EVICT, 2, 4, FULL], dtype=torch.uint8)[torch.randint(0, 4, (B, H, T), generator=g)]
    vb = torch.tensor([EVICT, 2, 4, FULL], dtype=torch.uint8)[torch.randint(0, 4, (B, H, T), generator=g)]
    valid = torch.rand(B, H, T, generator=g) > 0.2
    want = cap_plan(store, kb, vb, valid)
    got = cap_plan(store, kb, vb, valid, held=store.tiers())
    assert torch.equal(got.key_bits, want.key_bits) and torch.equal(got.bits_for_values, want.bits_for_values)
    assert bool((want.key_bits < kb).any())  # the held 4-bit entries did cap some planned full ones
    with pytest.raises(ValueError, match="held must be"):
        cap_plan(store, kb, vb, valid, held=store.tiers().key_bits)
    with pytest.raises(ValueError, match="held must be"):
        cap_plan(store, kb[..., :4], vb[..., :4], valid[..., :4], held=store.tiers())


def test_a_demotion_for_a_store_that_cannot_demote_is_refused():
    @dataclass(frozen=True)
    class Halving(Scorer):
        def score(self, ctx):
            return Scores(-ctx.keys.float().norm(dim=-1))

    class FourBitSelector(TopKSelector):
        plan_bits = frozenset({EVICT, 4})

        def select(self, scores, budget, protected=None, valid=None):
            keep = super().select(scores, budget, protected, valid).keep_keys
            return Plan(torch.where(keep, 4, EVICT).to(torch.uint8))

    keys, values, positions = _kv(10)
    store = DenseStore()
    store.append(keys, values, positions)
    comp = Compressor(Halving(), FourBitSelector(), _Tiered, Budget(ratio=0.5))  # a store holding 4 bits
    with pytest.raises(ValueError, match="cannot demote"):
        replan(store, comp)
    demoting = _Tiered()
    demoting.append(keys, values, positions)
    plan = replan(demoting, comp)
    assert plan.tiers() <= {EVICT, 4}


def test_span_summaries_ragged_extras_and_granularity_are_refused():
    class Spans(DenseStore):
        def read(self, query=None):
            v = super().read(query)
            return KVView(v.keys, v.values, v.positions, torch.where(v.valid, math.log(3.0), float("-inf")))

    keys, values, positions = _kv(11)
    spans = Spans()
    spans.append(keys, values, positions)
    with pytest.raises(ValueError, match="logit bias"):
        replan(spans, _compressor())
    ragged = _ragged_store(12)
    with pytest.raises(ValueError, match="ragged"):
        replan(ragged, _compressor(), extras={"surprisal": torch.zeros(B, T)})
    with pytest.raises(ValueError, match="granularity 'head'"):
        replan(ragged, _compressor(granularity="layer"))
    with pytest.raises(ValueError, match="holds no entries"):
        replan(DenseStore(), _compressor())
    with pytest.raises(ValueError, match=r"needs \['queries'\]"):
        replan(ragged, _compressor(WindowAttention()))
    with pytest.raises(TypeError, match="compressor"):
        replan(ragged, TopKSelector())
    with pytest.raises(ValueError, match="protect_before"):
        replan(ragged, _compressor(), protect_before=-1)


def test_uniform_extras_are_aligned_with_positions():
    from kvcore_toys import Surprisal

    keys, values, positions = _kv(13)
    store = DenseStore()
    store.append(keys, values, positions)
    surprisal = torch.randn(B, T)
    plan = replan(store, _compressor(Surprisal(), ratio=0.5), extras={"surprisal": surprisal})
    ctx = ScoringContext(keys, values, positions=positions, extras={"surprisal": surprisal})
    assert torch.equal(plan.key_bits, _compressor(Surprisal(), ratio=0.5).plan(ctx).key_bits)
