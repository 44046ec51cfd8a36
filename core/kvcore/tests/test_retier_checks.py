"""check_retier_plan: the validation every Store.retier shares."""

import pytest
import torch

from kvcore import EVICT, FULL, Plan, check_retier_plan


def u8(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.uint8)


def held() -> Plan:
    k = u8([[[FULL, 4, 4, EVICT]]])  # one head, three entries and one padding slot
    return Plan(k, u8([[[FULL, 4, 2, EVICT]]]))


def test_eviction_and_keeping_pass_and_come_back_on_the_held_device():
    plan = Plan(u8([[[FULL, EVICT, 4, EVICT]]]), u8([[[FULL, EVICT, 2, EVICT]]]))
    kb, vb = check_retier_plan(plan, held(), "ToyStore", eviction_only=True, same_kept=True)
    assert torch.equal(kb, plan.key_bits) and torch.equal(vb, plan.bits_for_values)
    demote = Plan(u8([[[FULL, 2, 1, EVICT]]]))
    check_retier_plan(demote, held(), "ToyStore", eviction_only=False)  # tier changes are the caller's to judge


@pytest.mark.parametrize(
    "plan, kw, match",
    [
        (Plan(torch.full((1, 1, 3), FULL, dtype=torch.uint8)), {}, "laid out like read\\(\\): shape \\(1, 1, 4\\)"),
        ("not a plan", {}, "kvcore.Plan"),
        (Plan(u8([[[FULL, 4, 4, 4]]])), {}, "plan.key_bits keeps entries the store does not hold"),
        (Plan(u8([[[FULL, 2, 4, EVICT]]])), {}, "ToyStore re-tiers by eviction only"),
        (
            Plan(u8([[[FULL, 4, 4, EVICT]]]), u8([[[FULL, EVICT, 2, EVICT]]])),
            {"same_kept": True},
            "same entries for keys and values in a ToyStore",
        ),
    ],
)
def test_bad_plans_name_what_is_wrong(plan, kw, match):
    with pytest.raises(ValueError, match=match):
        check_retier_plan(plan, held(), "ToyStore", eviction_only=True, **kw)


def test_element_masks_are_refused():
    plan = Plan(held().key_bits.clone(), full_precision=torch.zeros(1, 1, 4, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="ToyStore does not hold element-level"):
        check_retier_plan(plan, held(), "ToyStore", eviction_only=True)
