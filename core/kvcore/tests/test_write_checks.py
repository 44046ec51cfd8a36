"""check_write_plan and check_batch_index: the validation every tiered Store.write and every Store.reorder share."""

import pytest
import torch

from kvcore import EVICT, FULL, Plan, check_write_plan
from kvcore.checks import check_batch_index


def u8(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.uint8)


TIERS = {EVICT, FULL, 2}


def test_a_plan_of_held_tiers_passes_and_comes_back_on_the_device():
    plan = Plan(u8([[[FULL, 2, EVICT]]]), u8([[[FULL, 2, EVICT]]]))
    kb, vb = check_write_plan(plan, (1, 1, 3), torch.device("cpu"), "ToyStore", key_tiers=TIERS, same_kept=True)
    assert torch.equal(kb, plan.key_bits) and torch.equal(vb, plan.bits_for_values)
    assert kb.device == torch.device("cpu")


def test_keys_and_values_may_hold_different_tier_sets():
    plan = Plan(u8([[[FULL, 2]]]), u8([[[FULL, 4]]]))
    check_write_plan(plan, (1, 1, 2), "cpu", "ToyStore", key_tiers={FULL, 2}, value_tiers={FULL, 4})
    with pytest.raises(ValueError, match=r"plan.value_bits uses tiers \[4\]; this ToyStore holds \[2, 16\]"):
        check_write_plan(plan, (1, 1, 2), "cpu", "ToyStore", key_tiers={FULL, 2})


@pytest.mark.parametrize(
    "plan, kw, match",
    [
        ("not a plan", {}, r"plan must be a kvcore.Plan of shape \[B=1, H=1, T=3\]"),
        (Plan(u8([[[FULL, FULL]]])), {}, r"shape \[B=1, H=1, T=3\]"),
        (
            Plan(u8([[[FULL, 2, 2]]]), full_precision=torch.zeros(1, 1, 3, 4, dtype=torch.bool)),
            {"full_precision_note": ": it derives its own"},
            r"ToyStore does not hold element-level full-precision masks \(plan.full_precision\): it derives its own",
        ),
        (Plan(u8([[[FULL, 3, 4]]])), {}, r"plan.key_bits uses tiers \[3, 4\]; this ToyStore holds \[0, 2, 16\]"),
        (
            Plan(u8([[[FULL, 2, 2]]]), u8([[[FULL, 2, EVICT]]])),
            {"same_kept": True},
            "ToyStore needs the same kept entries for keys and values",
        ),
    ],
)
def test_bad_plans_are_refused_by_name(plan, kw, match):
    with pytest.raises(ValueError, match=match):
        check_write_plan(plan, (1, 1, 3), "cpu", "ToyStore", key_tiers=TIERS, **kw)


def test_different_kept_entries_pass_where_the_store_allows_them():
    plan = Plan(u8([[[FULL, 2, 2]]]), u8([[[FULL, 2, EVICT]]]))
    check_write_plan(plan, (1, 1, 3), "cpu", "ToyStore", key_tiers=TIERS)


def test_batch_index_rows_repeat_or_vanish_and_come_back_as_int64():
    got = check_batch_index("index", torch.tensor([2, 0, 0], dtype=torch.int32), 3)
    assert got.dtype == torch.int64 and got.tolist() == [2, 0, 0]
    assert check_batch_index("index", torch.tensor([], dtype=torch.int64), 3).numel() == 0
    assert check_batch_index("beam_idx", torch.tensor([7]), None).tolist() == [7]  # no batch known yet


@pytest.mark.parametrize(
    "index, batch, err, match",
    [
        (torch.tensor([0.0, 1.0]), 2, TypeError, "index must be an integer tensor"),
        (torch.tensor([[0]]), 2, ValueError, "index"),
        ([0, 1], 2, TypeError, "index must be a torch.Tensor"),
        (torch.tensor([0, 2]), 2, ValueError, r"index must hold batch rows in \[0, 2\), got \[0, 2\]"),
        (torch.tensor([-1]), 2, ValueError, r"in \[0, 2\)"),
        (torch.tensor([-1]), None, ValueError, "batch rows in >= 0"),
    ],
)
def test_bad_batch_indexes_are_refused_by_name(index, batch, err, match):
    with pytest.raises(err, match=match):
        check_batch_index("index", index, batch)
