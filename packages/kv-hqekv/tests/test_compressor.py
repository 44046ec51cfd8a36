"""Ready-made compressors: registry, decode-time properties (bits never increase, evicted never returns), and real
models through kv-hf (their conformance suite is in test_conformance.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_hqekv import HqeKVConfig, HqeKVStore, feasible, hqekv, requantize
from kvcore import EVICT, FULL, ScoringContext, registry

RANK = {EVICT: 0, 1: 1, 2: 2, 4: 3, FULL: 4}


def test_registry_names_and_budgets():
    names = registry.discover()
    for n in ("hqekv-2", "hqekv-3.2", "hqekv-2.8", "hqekv-3.25", "hqekv-qwen3-2"):
        assert n in names and names[n].budgets == frozenset()
    c = registry.build("hqekv-3.2")
    assert c.name == "hqekv-3.2" and c.budget.avg_bits == 3.2
    with pytest.raises(ValueError, match="takes budgets by only its default"):
        registry.build("hqekv-3.2", registry.get("hqekv-2").default)


def test_factory_errors():
    with pytest.raises(ValueError, match="needs shares"):
        hqekv(2.5)
    with pytest.raises(ValueError, match="unknown HqeKV preset"):
        hqekv(2.0, shares="llama-7")
    with pytest.raises(ValueError, match="avg_bits"):
        hqekv(3.2, shares="llama-2")
    with pytest.raises(TypeError, match="config"):
        hqekv(2.0, config={"block": 32})
    assert hqekv(2.5, shares=feasible(2.5, 0.05, 0.05)).budget.avg_bits == 2.5


def _tiers_by_position(store):
    t, pos = store.tiers(), store.read().positions
    out = {}
    for side, bits in (("k", t.key_bits), ("v", t.bits_for_values)):
        for b in range(pos.shape[0]):
            for h in range(pos.shape[1]):
                m = pos[b, h] >= 0
                for p, x in zip(pos[b, h][m].tolist(), bits[b, h][m].tolist()):
                    out[(side, b, h, p)] = RANK[x]
    return out


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([2.0, 3.2]), st.integers(40, 200), st.integers(0, 99), st.booleans())
def test_bits_never_increase_and_evicted_never_returns(bits, prompt_len, seed, joint):
    """Through prefill and 4 flushes of T tokens: every entry's tier only goes down, an evicted position never
    reappears, the residual stays below T, and the key-kept entries keep their true positions."""
    G = 8
    gen = torch.Generator().manual_seed(seed)
    B, H, Hq, D = 1, 2, 4, 16
    c = hqekv(
        bits, shares=feasible(bits, 0.1, 0.15), config=HqeKVConfig(block=G, period=G, window=4, joint_evict=joint)
    )
    k, v = torch.randn(B, H, prompt_len, D, generator=gen), torch.randn(B, H, prompt_len, D, generator=gen)
    store = c.compress(ScoringContext(keys=k, values=v, queries=torch.randn(B, Hq, 4, D, generator=gen)))
    before = _tiers_by_position(store)
    gone = {key for key, r in before.items() if r == 0}
    pos = prompt_len
    for _ in range(4):
        for _ in range(G):
            store.append(
                torch.randn(B, H, 1, D, generator=gen), torch.randn(B, H, 1, D, generator=gen), torch.tensor([[pos]])
            )
            pos += 1
        requantize(store, c, torch.randn(B, Hq, 4, D, generator=gen))
        after = _tiers_by_position(store)
        for key, r in after.items():
            assert key[3] < pos
            if key in before:
                assert r <= before[key], f"{key} moved up from {before[key]} to {r}"
            assert key not in gone or r == 0
        gone |= {key for key, r in before.items() if key not in after or after[key] == 0}
        assert all(key not in after or after[key] == 0 for key in gone)
        before = after
    held = store.tier_counts()
    assert int(held["keys_16"].max()) < 3 * G, "fp16 rows: at most 2 fp16 blocks plus a tail shorter than a block"


def test_demotion_transcodes_only_demoted_units():
    """A retier that demotes one block leaves every other unit's codes bit-identical and shrinks nbytes."""
    G = 4
    store = HqeKVStore(block=G)
    k, v = torch.randn(1, 1, 16, 64), torch.randn(1, 1, 16, 64)  # a head dim where codes outweigh metadata
    from kvcore import Plan

    bits = torch.tensor([[[4] * 8 + [2] * 8]], dtype=torch.uint8)
    store.write(k, v, Plan(bits), torch.arange(16)[None])
    n0, view0 = store.nbytes(), store.read()
    new = bits.clone()
    new[..., :4] = 1
    store.retier(Plan(new))
    view1 = store.read()
    assert torch.equal(view1.keys[..., 4:, :], view0.keys[..., 4:, :])
    assert torch.equal(view1.values[..., 4:, :], view0.values[..., 4:, :])
    assert store.nbytes() < n0
    with pytest.raises(ValueError, match="up a tier"):
        store.retier(Plan(bits))


@pytest.mark.parametrize("tier", [3, 8])
def test_retier_refuses_tiers_the_store_does_not_hold_and_values_moved_up(tier):
    """A plan with a width HqeKV does not hold (3, 8) or moving only the values up a tier is refused, naming the
    side, and leaves the store as it was."""
    from kvcore import Plan

    store = HqeKVStore(block=4)
    k, v = torch.randn(1, 1, 16, 64), torch.randn(1, 1, 16, 64)
    bits = torch.tensor([[[4] * 8 + [2] * 8]], dtype=torch.uint8)
    store.write(k, v, Plan(bits), torch.arange(16)[None])
    before = store.read()
    odd = bits.clone()
    odd[..., :4] = tier
    with pytest.raises(ValueError, match=rf"plan.key_bits uses tiers \[{tier}\]"):
        store.retier(Plan(odd))
    up = bits.clone()
    up[..., 8:] = 4
    with pytest.raises(ValueError, match="plan.value_bits moves 8 held entries up a tier"):
        store.retier(Plan(bits, up))
    after = store.read()
    assert torch.equal(after.keys, before.keys) and torch.equal(after.values, before.values)
