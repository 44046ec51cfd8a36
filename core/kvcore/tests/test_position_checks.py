"""kvcore.checks.check_positions against its definition: kept positions in [0, MAX_POSITION], strictly increasing
per head and beyond the last position held in their row (``after``)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcore.checks import MAX_POSITION, check_positions


def valid(p: torch.Tensor, keep: torch.Tensor, after: torch.Tensor | None) -> bool:
    """The definition, entry by entry."""
    B, H, T = keep.shape
    for b in range(B):
        for h in range(H):
            last = -1 if after is None else int(after[b])
            for t in range(T):
                if not keep[b, h, t]:
                    continue
                x = int(p[b, t])
                if x < 0 or x > MAX_POSITION or x <= last:
                    return False
                last = x
    return True


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 5),
    st.lists(st.sampled_from([-1, 0, 1, 2, 3, 5, 8, MAX_POSITION, MAX_POSITION + 1]), min_size=15, max_size=15),
    st.one_of(st.none(), st.lists(st.sampled_from([-1, 0, 2, 7]), min_size=3, max_size=3)),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_positions_are_accepted_exactly_when_the_definition_holds(B, T, pool, after, masked, seed):
    """With every entry kept (an append: one host read for valid positions) or a kept mask (a write), and with or
    without the row's last held position: ValueError exactly when a kept position is out of range, not strictly
    increasing, or not beyond ``after``; valid positions come back as int64."""
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor(pool[: B * T]).view(B, T)  # B·T <= 15 = len(pool)
    if bool(torch.rand(1, generator=g) < 0.5):  # half the cases start from valid increasing positions
        p = torch.sort(torch.randperm(20, generator=g)[: B * T].view(B, T), dim=-1).values
    a = None if after is None else torch.tensor(after[:B])
    keep = (torch.rand(B, 2, T, generator=g) < 0.7) if masked else torch.ones(B, 1, T, dtype=torch.bool)
    want = valid(p, keep, a)
    if want:
        got = check_positions("positions", p, (B, T), keep=keep if masked else None, after=a)
        assert got.dtype == torch.int64 and torch.equal(got, p.long())
    else:
        with pytest.raises(ValueError, match="positions"):
            check_positions("positions", p, (B, T), keep=keep if masked else None, after=a)
