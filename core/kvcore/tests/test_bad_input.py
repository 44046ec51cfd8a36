"""Bad input reaches a clear ValueError/TypeError at the value type or call that receives it (never NaN or a wrong
shape further down), and the AdaKV head floor of ``TopKSelector`` is honoured."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvcore_toys import KeyNorm

from kvcore import (
    Budget,
    Compressor,
    DenseStore,
    Plan,
    Protection,
    QuantizedTensor,
    Scores,
    ScoringContext,
    TieredSelector,
    TopKSelector,
)


def test_scores_reject_non_finite():
    for bad in (float("nan"), float("inf"), float("-inf")):
        s = torch.zeros(1, 1, 4)
        s[0, 0, 2] = bad
        with pytest.raises(ValueError, match="scores.keys must be finite"):
            Scores(s)
        with pytest.raises(ValueError, match="scores.values must be finite"):
            Scores(torch.zeros(1, 1, 4), s)


@pytest.mark.parametrize("width", [9, 15, 17, 200])
def test_plan_rejects_widths_outside_the_tiers(width):
    with pytest.raises(ValueError, match="key_bits holds"):
        Plan(torch.full((1, 1, 3), width, dtype=torch.uint8))
    ok = torch.full((1, 1, 3), 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="value_bits holds"):
        Plan(ok, torch.full((1, 1, 3), width, dtype=torch.uint8))


def _qt(**kw):
    fields = dict(
        codes=torch.zeros(2, 4, 2, dtype=torch.uint8),
        scales=torch.ones(2, 4, 1),
        zeros=torch.zeros(2, 4, 1),
        bits=4,
        axis="token",
        group_size=4,
        shape=(2, 4, 4),
        dtype=torch.float32,
    )
    return QuantizedTensor(**{**fields, **kw})


@pytest.mark.parametrize(
    "kw, err",
    [
        ({"bits": 0}, ValueError),
        ({"bits": 9}, ValueError),
        ({"bits": 2.0}, TypeError),
        ({"group_size": 0}, ValueError),
        ({"group_size": "4"}, TypeError),
        ({"scales": torch.ones(2, 4, 2)}, ValueError),
        ({"zeros": torch.zeros(2, 1, 4)}, ValueError),
        ({"scales": [1.0]}, TypeError),
        ({"shape": (4,)}, ValueError),
    ],
)
def test_quantized_tensor_rejects_bad_metadata(kw, err):
    _qt()  # the valid one builds
    with pytest.raises(err):
        _qt(**kw)


@pytest.mark.parametrize(
    "avg_bits, err", [("2", TypeError), (True, TypeError), (float("nan"), ValueError), (17, ValueError)]
)
def test_budget_avg_bits_is_a_number_in_range(avg_bits, err):
    with pytest.raises(err, match="avg_bits"):
        Budget(avg_bits=avg_bits)
    assert Budget(avg_bits=2).avg_bits == 2.0


def test_tiered_selector_rejects_bad_tiers_and_foreign_budgets():
    with pytest.raises(TypeError, match="tiers"):
        TieredSelector(tiers=(2.5, 0))
    with pytest.raises(ValueError, match=r"tiers .*must be one of \[0, 1, .*16\], got 12"):
        TieredSelector(tiers=(4, 12))
    with pytest.raises(ValueError, match="shares"):
        TieredSelector(tiers=(4, 0), shares={4: 1.5})
    sel = TieredSelector(tiers=(4, 0), shares={4: 0.5, 0: 0.5})
    s = Scores(torch.rand(1, 2, 8))
    assert sel.select(s, Budget()).keep_keys.sum() == 8  # ratio 0 (the default budget) is compatible
    for budget in (Budget(ratio=0.5), Budget(tokens=3)):
        with pytest.raises(ValueError, match="budgeted by its shares"):
            sel.select(s, budget)


@pytest.mark.parametrize("head_floor, err", [("0.2", TypeError), (None, TypeError), (1.5, ValueError)])
def test_topk_head_floor_validated(head_floor, err):
    with pytest.raises(err, match="head_floor"):
        TopKSelector(head_floor=head_floor)


class _IgnoresFloor(TopKSelector):
    """A mutant that drops the AdaKV floor: what the floor property below must catch."""

    def select(self, scores, budget, protected=None, valid=None):
        return super(_IgnoresFloor, dataclasses.replace(self, head_floor=0.0)).select(scores, budget, protected, valid)


def _floor_holds(selector: TopKSelector, scores: torch.Tensor, budget: Budget) -> bool:
    """Every head keeps its own best ``floor(head_floor * kept)`` entries (AdaKV's safeguard)."""
    keep = selector.select(Scores(scores), budget).keep_keys
    k = budget.kept(scores.shape[-1])
    floor = math.floor(selector.head_floor * k)
    best = torch.argsort(-scores, dim=-1, stable=True)[..., :floor]
    return bool(keep.gather(-1, best).all())


@settings(max_examples=30, deadline=None, database=None)
@given(
    H=st.integers(2, 4),
    T=st.integers(4, 40),
    ratio=st.sampled_from([0.5, 0.75, 0.9]),
    floor=st.sampled_from([0.2, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_topk_layer_budget_honours_the_head_floor(H, T, ratio, floor, seed):
    """Under a layer budget each head keeps at least its own top ``floor(head_floor * kept)`` entries, even when
    another head's scores dominate the whole layer."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(1, H, T, generator=g)
    scores[:, 0] += 10.0  # head 0 would take the whole layer budget without the floor
    budget = Budget(ratio=ratio, granularity="layer")
    assert _floor_holds(TopKSelector(head_floor=floor), scores, budget)


def test_the_head_floor_property_catches_a_selector_that_ignores_it():
    scores = torch.rand(1, 3, 20, generator=torch.Generator().manual_seed(0))
    scores[:, 0] += 10.0  # head 0 holds 20 entries, more than the layer's 3 * 5 kept: it takes them all unfloored
    budget = Budget(ratio=0.75, granularity="layer")
    assert _floor_holds(TopKSelector(head_floor=0.5), scores, budget)
    assert not _floor_holds(_IgnoresFloor(head_floor=0.5), scores, budget)


def _ctx(**kw):
    x = torch.randn(1, 2, 8, 4)
    return ScoringContext(**{"keys": x, "values": x.clone(), **kw})


@pytest.mark.parametrize("name", ["keys", "values"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_compressor_rejects_non_finite_inputs_naming_tensor_and_layer(name, bad):
    comp = Compressor(KeyNorm(), TopKSelector(), DenseStore, Budget(ratio=0.5))
    t = torch.randn(1, 2, 8, 4)
    t[0, 1, 3, 2] = bad
    ctx = _ctx(**{name: t, "layer_idx": 5})
    with pytest.raises(ValueError, match=f"{name} of layer 5 hold NaN or inf"):
        comp.compress(ctx)
    assert dataclasses.replace(comp, validate=False).plan(_ctx(layer_idx=5)).key_bits.shape == (1, 2, 8)


def test_compressor_rejects_a_context_that_is_not_one():
    comp = Compressor(KeyNorm(), TopKSelector(), DenseStore, Budget(ratio=0.5))
    x = torch.randn(1, 2, 8, 4)
    with pytest.raises(TypeError, match="ScoringContext"):
        comp.compress((x, x))
    with pytest.raises(TypeError, match="strict"):
        Compressor(KeyNorm(), TopKSelector(), DenseStore, strict="no")


def _written(positions, keep=None):
    x = torch.randn(1, 1, positions.shape[-1], 4)
    keep = torch.ones(1, 1, positions.shape[-1], dtype=torch.bool) if keep is None else keep
    store = DenseStore()
    store.write(x, x, Plan.from_keep(keep), positions)
    return store


@pytest.mark.parametrize(
    "positions",
    [torch.tensor([[0, -1, 2]]), torch.tensor([[0, 2, 2]]), torch.tensor([[3, 1, 2]]), torch.tensor([[0, 1, 2**31]])],
    ids=["negative", "duplicate", "descending", "beyond int32"],
)
def test_dense_store_rejects_bad_positions_on_write(positions):
    with pytest.raises(ValueError, match="positions"):
        _written(positions)


def test_dense_store_positions_of_evicted_entries_are_not_checked():
    store = _written(torch.tensor([[0, 0, 1]]), keep=torch.tensor([[[False, True, True]]]))  # left padding at 0
    assert store.read().positions.tolist() == [[[0, 1]]]


def test_dense_store_append_must_follow_what_is_held():
    store = _written(torch.arange(4)[None])
    x = torch.randn(1, 1, 2, 4)
    before = store.read()
    for bad in (torch.tensor([[3, 4]]), torch.tensor([[6, 5]]), torch.tensor([[-2, 7]])):
        with pytest.raises(ValueError, match="positions"):
            store.append(x, x, bad)
        after = store.read()
        assert torch.equal(after.positions, before.positions) and torch.equal(after.keys, before.keys)
    store.append(x, x, torch.tensor([[7, 9]]))
    assert store.read().positions.tolist() == [[[0, 1, 2, 3, 7, 9]]]


@pytest.mark.parametrize("position, err", [(2.5, TypeError), ("3", TypeError), (True, TypeError), (-1, ValueError)])
def test_dense_store_crop_takes_a_non_negative_int(position, err):
    with pytest.raises(err, match="position"):
        _written(torch.arange(4)[None]).crop(position)


def test_dense_store_reorder_takes_an_integer_index_and_growth_an_int():
    store = _written(torch.arange(4)[None])
    with pytest.raises(TypeError, match="index"):
        store.reorder(torch.tensor([0.0]))
    with pytest.raises(TypeError, match="growth"):
        DenseStore(growth=2.5)
    with pytest.raises(ValueError, match="growth"):
        DenseStore(growth=-1)


def test_reference_attention_names_mismatched_queries():
    store = _written(torch.arange(4)[None])
    view = store.read()
    for q in (torch.randn(1, 1, 1, 3), torch.randn(2, 1, 1, 4), torch.randn(1, 1, 4)):
        with pytest.raises(ValueError, match="query"):
            view.attend(q)
    with pytest.raises(TypeError, match="query"):
        view.attend(torch.ones(1, 1, 1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="scale"):
        view.attend(torch.randn(1, 1, 1, 4), scale=float("nan"))


def test_protection_is_unchanged_by_the_checks():
    assert Protection(sinks=2, recent=3).mask(torch.ones(1, 8, dtype=torch.bool)).sum() == 5


# -- value checks on accelerators (kvcore.checks, "Value checks on accelerators") --------------------------------
def test_value_checks_default_on_for_cpu_tensors_and_switchable():
    from kvcore import DenseStore, value_checks
    from kvcore.checks import values_checked

    kv = torch.zeros(1, 2, 3, 4)
    assert values_checked(kv)
    with value_checks(False):
        assert not values_checked(kv)
        with value_checks(True):
            assert values_checked(kv)
        assert not values_checked(kv)
    assert values_checked(kv)
    assert not values_checked(torch.zeros(1, device="meta"))  # an accelerator-like device: off by default
    with value_checks(True):
        assert values_checked(torch.zeros(1, device="meta"))
    with pytest.raises(TypeError, match="enabled must be a bool"), value_checks(1):
        pass

    store = DenseStore()
    store.append(kv, kv, torch.tensor([[0, 1, 2]]))
    nan = torch.full((1, 2, 1, 4), float("nan"))
    with pytest.raises(ValueError, match="keys must be finite"):
        store.append(nan, kv[:, :, :1], torch.tensor([[3]]))
    with pytest.raises(ValueError, match="strictly increasing"):
        store.append(kv[:, :, :1], kv[:, :, :1], torch.tensor([[2]]))
    assert store.seq_lengths().tolist() == [[3, 3]]
    with value_checks(False):  # values are not read; shapes and dtypes still are
        store.append(nan, kv[:, :, :1], torch.tensor([[3]]))
        with pytest.raises(TypeError, match="positions must be an int"):
            store.append(kv[:, :, :1], kv[:, :, :1], torch.tensor([[4.0]]))
        with pytest.raises(ValueError, match=r"positions must have shape \[B=1, T=1\]"):
            store.append(kv[:, :, :1], kv[:, :, :1], torch.tensor([[4, 5]]))
    assert store.seq_lengths().tolist() == [[4, 4]]
    assert bool(store.read().keys[0, :, 3].isnan().all())


def test_dense_store_finds_its_last_positions_after_unchecked_appends():
    """Unchecked appends (accelerators by default) do not copy each step's last positions; a checked append after
    them finds the largest held position from the layout and still refuses one that does not follow it."""
    from kvcore import DenseStore, value_checks

    kv = torch.zeros(2, 1, 1, 4)
    store = DenseStore()
    store.append(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), torch.tensor([[0, 1, 2], [4, 5, 6]]))
    with value_checks(False):
        store.append(kv, kv, torch.tensor([[3], [9]]))
        store.append(kv, kv, torch.tensor([[7], [10]]))
    assert store._last is None  # nothing copied for the checks that did not run
    with pytest.raises(ValueError, match="positions"):
        store.append(kv, kv, torch.tensor([[8], [10]]))  # row 1 holds position 10 already
    store.append(kv, kv, torch.tensor([[8], [11]]))
    assert store.read().positions[:, 0].tolist() == [[0, 1, 2, 3, 7, 8], [4, 5, 6, 9, 10, 11]]


def test_a_uniform_dense_read_holds_no_bias():
    """Heads of one length: the view is bias-free and its zero bias is one shared zero expanded (no per-read fill),
    which attention treats as zeros and an in-place write refuses."""
    from kvcore import DenseStore, reference_attention

    store = DenseStore()
    kv = torch.randn(2, 3, 5, 4)
    store.append(kv, kv, torch.arange(5).expand(2, 5))
    view = store.read()
    assert view.bias_free and view.logit_bias.shape == (2, 3, 5) and view.logit_bias.stride() == (0, 0, 0)
    assert store.read().logit_bias.data_ptr() == view.logit_bias.data_ptr() and not bool(view.logit_bias.any())
    q = torch.randn(2, 3, 1, 4)
    out = reference_attention(view, q)[0]
    ref = torch.softmax(q @ kv.transpose(-1, -2) / 2.0, -1) @ kv
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):
        view.logit_bias.add_(1.0)


def test_dense_store_uniform_length_is_known_on_the_host_only_when_it_is():
    """``uniform_length()``: every head's length when the host knows it (a read or an append learnt it), ``None``
    before, after another edit, and when heads differ -- never a read of its own."""
    from kvcore import EVICT, FULL, DenseStore
    from kvcore.testing.host_reads import HostReads

    store = DenseStore()
    assert store.uniform_length() is None
    kv = torch.randn(1, 2, 4, 4)
    store.append(kv, kv, torch.arange(4)[None])
    store.append(kv[:, :, :1], kv[:, :, :1], torch.tensor([[4]]))
    with HostReads() as reads:
        assert store.uniform_length() == 5
    assert reads.total == 0
    store.crop(3)
    assert store.uniform_length() is None  # forgotten by the edit
    store.read()
    assert store.uniform_length() == 3  # learnt again by the read
    store.retier(Plan(torch.tensor([[[FULL, FULL, EVICT], [FULL, FULL, FULL]]], dtype=torch.uint8)))
    store.read()
    assert store.uniform_length() is None and store.seq_lengths().tolist() == [[2, 3]]  # heads differ


def test_value_checks_from_the_environment(monkeypatch):
    from kvcore.checks import values_checked

    meta = torch.zeros(1, device="meta")
    monkeypatch.setenv("KVCORE_VALUE_CHECKS", "1")
    assert values_checked(meta)
    monkeypatch.setenv("KVCORE_VALUE_CHECKS", "0")
    assert not values_checked(meta)


def test_host_reads_counts_what_syncs_and_nothing_else():
    from kvcore.testing.host_reads import HostReads

    x = torch.arange(6.0)
    with HostReads(sites=True) as reads:
        y = (x * 2).sum() + x.amax()  # device work only
        _ = x.view(2, 3).t().contiguous()
    assert reads.total == 0 and y.shape == ()
    with HostReads(sites=True) as reads:
        int(x[0])
        bool(x.any())
        x.tolist()
        x[x > 2]
        torch.nonzero(x)
        x.to("cpu")
        x.to(x.device)  # device-generic: not counted
        x.repeat_interleave(2)  # int repeats: no read
        x.repeat_interleave(torch.ones(6, dtype=torch.long))  # tensor repeats, no output_size: a read
        torch.repeat_interleave(torch.ones(6, dtype=torch.long))  # the one-argument form: a read
        torch.repeat_interleave(x, torch.ones(6, dtype=torch.long), output_size=6)  # size given: none
    assert reads.total == 8, dict(reads.by_site)
    ops = {op for (_site, op) in reads.by_site}
    assert ops == {
        "__int__", "__bool__", "tolist", "bool-mask index", "torch.nonzero", "to cpu", "repeat_interleave",
        "torch.repeat_interleave",
    }  # fmt: skip
    assert all("test_bad_input" in site for (site, _op) in reads.by_site)
    with HostReads() as outer:  # nested counters both count; leaving restores torch
        with HostReads() as inner:
            x[0].item()
        x[1].item()
    assert (inner.total, outer.total) == (1, 2)
    assert torch.Tensor.item.__name__ == "item" and not hasattr(torch.Tensor.item, "__wrapped__")


def test_host_reads_counts_copies_of_host_data_to_a_device():
    """A list or number copied to a device, and a Python-list index, wait for the GPU like a read."""
    from kvcore.testing.host_reads import HostReads

    x = torch.arange(6.0)
    with HostReads(sites=True) as reads:
        torch.tensor([1, 2], device=x.device)  # host data to the tensor's device: counted
        torch.as_tensor(3.0, device=x.device)
        x[[0, 2]]  # a list index is copied to x's device
        x[[1]] = 5.0
        torch.tensor([1, 2])  # a host tensor: none
        torch.tensor([1, 2], device="cpu")  # explicitly the host: none
        torch.as_tensor(x, device=x.device)  # already a tensor (device-generic, like .to): none
        torch.full((2,), 1.0, device=x.device)  # a fill on the device: none
        x[torch.tensor([0, 2])]  # a tensor index: none
        x[0:2]
    assert reads.total == 4, dict(reads.by_site)
    assert {op for (_site, op) in reads.by_site} == {
        "torch.tensor to device", "torch.as_tensor to device", "list index", "list-index assign",
    }  # fmt: skip
    # __getitem__ and __setitem__ are wrapped twice (bool masks, lists): leaving unwraps both layers
    assert not hasattr(torch.Tensor.__getitem__, "__wrapped__") and not hasattr(torch.tensor, "__wrapped__")


@pytest.mark.parametrize(
    ("value", "kw", "err", "match"),
    [
        (True, {}, TypeError, "bits must be an int, got bool"),
        (4.0, {}, TypeError, "bits must be an int, got float"),
        ("4", {"choices": (2, 4)}, TypeError, "bits must be an int"),
        (3, {"choices": (4, 2)}, ValueError, r"bits must be one of \[2, 4\], got 3"),
        (0, {"low": 1}, ValueError, "bits must be an int >= 1, got 0"),
        (0, {"low": 1, "optional": "the whole axis"}, ValueError, r"or None \(the whole axis\), got 0"),
        ("x", {"optional": "no limit"}, TypeError, r"an int or None \(no limit\)"),
    ],
)
def test_check_int_names_the_argument_and_what_is_allowed(value, kw, err, match):
    from kvcore.checks import check_int

    with pytest.raises(err, match=match):
        check_int("bits", value, **kw)


def test_check_int_returns_ints_and_lets_none_through_only_when_optional():
    import numpy as np

    from kvcore.checks import check_int

    assert check_int("n", np.int16(3), choices=(1, 3)) == 3 and type(check_int("n", np.int16(3))) is int
    assert check_int("n", None, optional="no limit") is None
    with pytest.raises(TypeError, match="n must be an int, got NoneType"):
        check_int("n", None)


def test_check_power_of_two():
    from kvcore.checks import check_power_of_two

    assert check_power_of_two("block", 64, low=16) == 64 and check_power_of_two("b", None, optional="auto") is None
    with pytest.raises(ValueError, match="block must be a power of two >= 16, got 48"):
        check_power_of_two("block", 48, low=16)
    with pytest.raises(ValueError, match=">= 16"):
        check_power_of_two("block", 8, low=16)
    with pytest.raises(TypeError, match="block must be an int"):
        check_power_of_two("block", 16.0)
