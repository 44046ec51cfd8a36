"""``Segment.slots``: the slot of every entry, found with one search over all batch rows (no per-row loop, no host
read), equals a per-row search."""

from types import SimpleNamespace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_hex.segment import Segment


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 3), n=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_slots_equal_a_search_per_row(B, H, n, seed):
    g = torch.Generator().manual_seed(seed)
    # per row: increasing true positions in the slots, some slots empty (-1), positions up to int32's range
    step = torch.randint(1, 2**27, (B, n), generator=g)
    slot_pos = torch.cumsum(step, -1)
    slot_pos[torch.rand(B, n, generator=g) < 0.3] = -1
    held = (slot_pos >= 0)[:, None, :].expand(B, H, n) & (torch.rand(B, H, n, generator=g) < 0.7)
    seg = torch.arange(B * H)[:, None].expand(B * H, n).reshape(B, H, n)[held]
    pos = slot_pos[:, None, :].expand(B, H, n)[held]
    fake = SimpleNamespace(slot_pos=slot_pos.int(), pos=pos.int(), H=H)
    got = Segment.slots(fake, seg)
    want = torch.tensor(
        [int((slot_pos[s // H] == p).nonzero()[0]) for s, p in zip(seg.tolist(), pos.tolist())], dtype=torch.long
    )
    assert torch.equal(got, want)
