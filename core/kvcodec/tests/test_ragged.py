"""The ragged residual: KIVI's append / pop-oldest policies over flat rows, and evicted entries hold no memory."""

import torch

from kvcodec.ragged import Residual
from kvcore import storage_bytes


def _empty(S, D, dtype=torch.float32):
    x = torch.zeros(1, S, 0, D, dtype=dtype)
    return Residual.from_mask(x, torch.zeros(1, S, 0, dtype=torch.bool), torch.zeros(1, S, 0, dtype=torch.int32))


def _held(r: Residual) -> dict:
    seg, pos = r.positions()
    return {(int(s), int(p)): row for s, p, row in zip(seg, pos, r.rows)}


def _bytes(r: Residual) -> int:
    return storage_bytes([r.rows, r.pos, r.counts])


def test_push_then_pop_front_is_a_fifo_per_segment():
    S, D = 3, 4
    gen = torch.Generator().manual_seed(0)
    r, pushed = _empty(S, D), {}
    for step in range(4):
        rows = torch.randn(S, 2, D, generator=gen)
        pos = torch.tensor([[2 * step, 2 * step + 1]] * S)
        r.push(rows, pos)
        pushed.update({(s, 2 * step + j): rows[s, j] for s in range(S) for j in range(2)})
    assert r.length.tolist() == [8, 8, 8]
    k = torch.tensor([0, 3, 8])
    rows, seg, pos = r.pop_front(k)
    assert seg.tolist() == [1, 1, 1] + [2] * 8 and pos.tolist() == [0, 1, 2] + list(range(8))
    for s, p, row in zip(seg.tolist(), pos.tolist(), rows):
        assert torch.equal(row, pushed.pop((s, p)))
    assert r.length.tolist() == [8, 5, 0]
    held = _held(r)
    assert held.keys() == pushed.keys() and all(torch.equal(held[e], pushed[e]) for e in held)
    seg, pos = r.positions()  # oldest first inside a segment
    assert torch.equal(seg, torch.sort(seg, stable=True).values)
    assert all(bool((pos[seg == s].diff() > 0).all()) for s in range(S))


def test_bytes_are_exactly_the_held_entries():
    """A residual holds its rows and positions and nothing else: the same entries written directly hold the same
    bytes, and evicting an entry of a short segment frees its row and position."""
    S, D = 2, 4
    gen = torch.Generator().manual_seed(1)
    r = _empty(S, D)
    r.push(torch.randn(S, 3, D, generator=gen), torch.arange(3).expand(S, 3))
    r.pop_front(torch.tensor([0, 2]))  # segment 1 is now shorter than segment 0
    x = torch.zeros(1, S, 3, D)
    mask = torch.tensor([[[True] * 3, [False, False, True]]])
    direct = Residual.from_mask(x, mask, torch.arange(3).expand(1, S, 3).int())
    assert _bytes(r) == _bytes(direct) == 4 * (4 * D + 2) + 8 * S  # int16 positions while they fit
    before = _bytes(r)
    r.keep(torch.tensor([True, True, True, False]))  # evict the only entry of segment 1
    assert r.length.tolist() == [3, 0]
    assert _bytes(r) == before - (4 * D + 2)
