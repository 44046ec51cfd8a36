"""The decode-time re-plan from the window state (§3.5, Alg. 3): same plan as re-scoring the ``read()`` view, without
reading the store back."""

import copy
import dataclasses

import pytest
import torch

from kv_hqekv import HqeKVConfig, hqekv, requantize
from kv_hqekv.window import held_value_ranges, window_replan
from kvcore import ScoringContext, replan_view

B, H, HQ, D, N, G = 2, 2, 4, 64, 200, 8


def decoded_store(seed=0, bits=2.0, dtype=torch.float32):
    """An HqeKV store after a prefill of ``N`` tokens and one period of decode appends, with its compressor."""
    g = torch.Generator().manual_seed(seed)
    c = hqekv(bits, config=HqeKVConfig(block=G, period=G, fp16_blocks=2))
    k, v = torch.randn(2, B, H, N, D, generator=g).to(dtype)
    queries = torch.randn(B, HQ, 20, D, generator=g).to(dtype)
    store = c.compress(ScoringContext(keys=k, values=v, queries=queries))
    for i in range(G):
        new = torch.randn(2, B, H, 1, D, generator=g).to(dtype)
        store.append(new[0], new[1], torch.full((B, 1), N + i))
    return store, c, torch.randn(B, HQ, 20, D, generator=g).to(dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_replan_equals_the_read_view_replan(seed):
    """Scores from the held keys and the held value statistics give the plan kvcore's read()-based re-plan gives
    (the range of a uniform group is [zero, zero + (2^b-1)·scale] exactly as the dequantized view spans it)."""
    store, c, q = decoded_store(seed)
    decode = dataclasses.replace(c, selector=c.selector.for_decoding())
    old = replan_view(store, decode, queries=q)
    new = window_replan(store, c, queries=q)
    assert torch.equal(old.key_bits, new.key_bits)
    assert torch.equal(old.bits_for_values, new.bits_for_values)


def test_window_replan_never_reads_the_store_back(monkeypatch):
    """requantize scores, selects and re-tiers without calling read() (no dequantized values, no view)."""
    store, c, q = decoded_store()
    before = store.tiers()

    def forbidden(*args, **kwargs):
        raise AssertionError("read() called by the decode re-plan")

    monkeypatch.setattr(store, "read", forbidden)
    plan = requantize(store, c, q)
    after = store.tiers()
    monkeypatch.undo()
    assert torch.equal(plan.key_bits, after.key_bits)
    rank = torch.tensor([0, 1, 2, 0, 3] + [0] * 11 + [4])
    assert bool((rank[after.key_bits.long()] <= rank[before.key_bits.long()]).all())  # bits never increase


def test_held_value_ranges_match_the_dequantized_view():
    """The range read from the group statistics equals the range of the dequantized values (0 where evicted)."""
    store, _, _ = decoded_store(3)
    view = store.read()
    expect = (view.values.float().amax(-1) - view.values.float().amin(-1)).masked_fill(view.positions < 0, 0)
    torch.testing.assert_close(held_value_ranges(store), expect, rtol=1e-5, atol=1e-5)


def test_falls_back_to_the_view_replan_where_the_state_does_not_apply():
    """protect_before (not HqeKV state) goes through replan_view: the same plan either way."""
    store, c, q = decoded_store(4)
    decode = dataclasses.replace(c, selector=c.selector.for_decoding())
    old = replan_view(store, decode, queries=q, protect_before=0)
    new = window_replan(store, c, queries=q, protect_before=0)
    assert torch.equal(old.key_bits, new.key_bits)


def test_compressor_declares_its_decode_retiering():
    """hqekv() compressors re-plan every T decoded tokens with the window re-planner (kvcore.replan runs it)."""
    c = hqekv(2.0)
    assert c.replan_every == HqeKVConfig().period == 32 and c.replanner is window_replan


@pytest.mark.parametrize(("seed", "dtype"), [(0, torch.float16), (1, torch.bfloat16), (2, torch.float32)])
def test_the_fused_path_scores_the_window_from_the_held_codes(monkeypatch, seed, dtype):
    """On the fused (Triton) path a half-precision cache's re-plan scores the window over the store's block layout,
    each key dequantized in registers (interpreted here), never building the dense keys; a float32 cache takes the
    dense keys (the kernel's float32 variant over the layout spills for sm_90). Either way the plan equals the CPU
    path's."""
    pytest.importorskip("triton")
    from kv_hqekv import importance, window
    from kv_hqekv.kernels import dispatch

    store, c, q = decoded_store(seed, dtype=dtype)
    want = window_replan(store, c, queries=q)
    assert store._blocks is None  # the CPU path takes no layout
    for mod in (window, importance, dispatch):
        monkeypatch.setattr(mod, "use_triton", lambda t: True)
    dense_calls = []
    dense_keys = window._dense_keys

    def counted(*args, **kwargs):
        dense_calls.append(1)
        return dense_keys(*args, **kwargs)

    monkeypatch.setattr(window, "_dense_keys", counted)
    got = window_replan(store, c, queries=q)
    half = dtype != torch.float32
    assert bool(store._blocks) == half and len(dense_calls) == (0 if half else 1)
    assert torch.equal(got.key_bits, want.key_bits) and torch.equal(got.bits_for_values, want.bits_for_values)


def test_window_importance_over_a_block_layout_rejects_bad_input():
    """Wrong types, a query batch or head dim that does not match the layout, more window rows than held entries and
    a padding mask of the wrong width get clear errors."""
    from kv_hqekv import window_importance_blocked

    store, _, q = decoded_store()
    layout, keys, _ = store.decode_layout()
    with pytest.raises(TypeError, match="BlockLayout"):
        window_importance_blocked(q, keys, keys)
    with pytest.raises(ValueError, match="queries must be"):
        window_importance_blocked(q[:1], layout, keys)
    with pytest.raises(ValueError, match="head dim"):
        window_importance_blocked(q[..., :8], layout, keys)
    with pytest.raises(ValueError, match="valid must be"):
        window_importance_blocked(q, layout, keys, torch.ones(B, 3, dtype=torch.bool))
    assert window_importance_blocked(q, layout, keys).shape == (B, layout.width)


def _state(store):
    view = store.read()
    tiers = store.tiers()
    return (view.keys, view.values, view.positions, tiers.key_bits, tiers.bits_for_values, store.nbytes())


def _same(a, b):
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("seed", [0, 5])
def test_a_capped_plan_spares_the_retier_finding_the_slots_again(monkeypatch, seed):
    """The window re-plan's plan carries the entries' slots and held tiers it was capped against: the store's next
    retier uses them (no second sort of the held entries) and ends exactly where the same tiers as a plain Plan end;
    the carried state is dropped once a retier took the plan."""
    from kv_hqekv import CappedPlan, HqeKVStore
    from kvcore import Plan

    store, c, q = decoded_store(seed)
    twin = copy.deepcopy(store)
    plan = window_replan(store, c, queries=q)
    assert isinstance(plan, CappedPlan) and len(plan.memo) == 4
    calls = []
    all_slots = HqeKVStore._all_slots
    monkeypatch.setattr(HqeKVStore, "_all_slots", lambda self, *a, **k: calls.append(1) or all_slots(self, *a, **k))
    store.retier(plan)
    assert calls == [] and plan.memo == []
    twin.retier(Plan(plan.key_bits, plan.value_bits))
    assert calls == [1]
    _same(_state(store), _state(twin))


def test_a_capped_plan_after_another_edit_or_for_another_store_finds_the_slots_again(monkeypatch):
    """An edit between the re-plan and the retier (here a crop that drops nothing), or a plan capped against another
    store, makes the retier find the slots itself: same result as a plain Plan."""
    from kv_hqekv import HqeKVStore
    from kvcore import Plan

    store, c, q = decoded_store(6)
    other, twin = copy.deepcopy(store), copy.deepcopy(store)
    plan = window_replan(store, c, queries=q)
    plain = Plan(plan.key_bits, plan.value_bits)
    calls = []
    all_slots = HqeKVStore._all_slots
    monkeypatch.setattr(HqeKVStore, "_all_slots", lambda self, *a, **k: calls.append(1) or all_slots(self, *a, **k))
    other.retier(plan)  # capped against `store`, not `other`
    assert len(calls) == 1 and plan.memo == []
    plan = window_replan(store, c, queries=q)
    calls.clear()
    store.crop(10**6)  # an edit (nothing dropped)
    store.retier(plan)
    assert len(calls) == 1
    twin.retier(plain)
    _same(_state(store), _state(twin))
    _same(_state(other), _state(twin))
