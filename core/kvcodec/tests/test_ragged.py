"""The ragged residual: KIVI's append / pop-oldest policies over flat rows, and evicted entries hold no memory."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 70_000), max_size=40))
def test_position_runs_round_trip_exactly(values):
    """``expand_runs(position_runs(p)) == p`` for any position vector (runs break wherever p[i+1] != p[i] + 1);
    starts narrow to int16 only while every start fits."""
    from kvcodec.ragged import expand_runs, position_runs

    p = torch.tensor(values, dtype=torch.int32)
    starts, lengths = position_runs(p)
    assert expand_runs(starts, lengths).tolist() == values
    assert int(lengths.sum()) == len(values)
    assert starts.dtype == (torch.int16 if max(values, default=0) <= 32_767 else torch.int32)


def test_quantized_positions_cost_one_run_per_unit_and_survive_edits():
    """A quantization unit of consecutive tokens holds its positions as one run (start, length), not one position
    per row; keep / crop / take_segments / widening past int16 return exactly the positions they should."""
    from kvcodec import UniformQuantizer
    from kvcodec.ragged import QuantUnits

    S, U, D = 2, 8, 16
    g = torch.Generator().manual_seed(0)
    units = QuantUnits(UniformQuantizer(2, "channel", U), U)
    pos = torch.arange(4 * U).view(4, U).int()  # segment 0: units 0-1, segment 1: units 2-3, consecutive positions
    seg = torch.tensor([0, 0, 1, 1])
    units.add(torch.randn(4, U, D, generator=g), seg, pos)
    assert units._pos_starts.numel() == 1  # all 32 positions are consecutive: a single run
    assert units.positions()[1].tolist() == list(range(4 * U))
    keep = torch.ones(4 * U, dtype=torch.bool)
    keep[[3, 4, 20]] = False
    units.keep(keep)
    want = [p for p in range(4 * U) if p not in (3, 4, 20)]
    assert units.positions()[1].tolist() == want and units._pos_starts.numel() == 3
    units.crop(18)
    want = [p for p in want if p < 18]
    assert units.positions()[1].tolist() == want
    assert units.positions()[0].tolist() == [0] * (2 * U - 2) + [1] * (len(want) - 2 * U + 2)
    units.take_segments(torch.tensor([1, 0]), S)  # swap the segments
    assert units.positions()[0].tolist() == [0] * 2 + [1] * (2 * U - 2)
    assert units.positions()[1].tolist() == [16, 17] + [p for p in want if p < 16]
    far = torch.arange(40_000, 40_000 + U).int()[None]  # a unit beyond int16 widens the runs for good
    units.add(torch.randn(1, U, D, generator=g), torch.tensor([1]), far)
    assert units._pos_starts.dtype == torch.int32 and units.positions()[1].tolist()[-U:] == far[0].tolist()
    units.crop(40_000)
    assert units._pos_starts.dtype == torch.int32 and 40_000 not in units.positions()[1].tolist()


def test_adding_units_without_value_checks_reads_nothing_and_keeps_every_position():
    """An accelerator's default (value checks off): appending quantized units whose real rows the caller counts finds
    no narrow dtype and merges no run on the host (the joined runs stay split, int32), and the positions and segments
    read back exactly as with the checks on; the next re-encoding (a keep) merges the runs again."""
    from kvcodec import UniformQuantizer
    from kvcodec.ragged import QuantUnits
    from kvcore import value_checks
    from kvcore.testing.host_reads import HostReads

    U, D = 4, 8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, U, D, generator=g)
    pos = torch.arange(6 * U).view(6, U).int()
    seg = torch.tensor([0, 0, 0, 1, 1, 1])
    checked, unchecked = (QuantUnits(UniformQuantizer(2, "channel", U), U) for _ in range(2))
    q = checked.quantizer.quantize(x)
    checked.add_quantized(q.__class__(**{**vars(q)}), seg, pos)
    halves = [slice(0, 2), slice(2, 6)]  # the second add continues the first one's run and segment
    with value_checks(False):
        qs = [unchecked.quantizer.quantize(x[h]) for h in halves]
        with HostReads() as reads:
            for h, qh in zip(halves, qs):
                unchecked.add_quantized(qh, seg[h], pos[h], real_rows=pos[h].numel())
    assert reads.total == 0
    assert unchecked._pos_starts.dtype == torch.int32 and unchecked._pos_starts.numel() == 2  # unmerged
    assert checked._pos_starts.dtype == torch.int16 and checked._pos_starts.numel() == 1
    for a, b in zip(unchecked.positions(), checked.positions()):
        assert torch.equal(a.long(), b.long())
    assert torch.equal(unchecked.codes[: unchecked.nr], checked.codes[: checked.nr])
    keep = torch.ones(6 * U, dtype=torch.bool)
    unchecked.keep(keep)
    assert unchecked._pos_starts.numel() == 1 and unchecked.positions()[1].tolist() == list(range(6 * U))


def test_push_without_value_checks_reads_nothing_and_holds_int32_positions():
    # an accelerator's default (value checks off): no host read per push, positions held in int32 for good; with the
    # checks on (the CPU's default) the narrowest dtype, read from the new positions
    from kvcore import value_checks
    from kvcore.testing.host_reads import HostReads

    gen = torch.Generator().manual_seed(2)
    checked, unchecked = _empty(2, 4), _empty(2, 4)
    rows = torch.randn(2, 3, 4, generator=gen)
    pos = torch.arange(3).expand(2, 3)
    with value_checks(False), HostReads() as reads:
        unchecked.push(rows, pos)
        unchecked.push(rows, pos + 3)
    checked.push(rows, pos)
    checked.push(rows, pos + 3)
    assert reads.total == 0
    assert unchecked.pos.dtype == torch.int32 and checked.pos.dtype == torch.int16
    assert torch.equal(unchecked.rows, checked.rows) and torch.equal(unchecked.pos.int(), checked.pos.int())


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    S=st.integers(1, 4),
    first=st.integers(0, 5),
    pushes=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    ragged=st.booleans(),
)
def test_push_by_concatenation_equals_the_scatter(seed, S, first, pushes, ragged):
    """Invariant: where every segment holds as many rows (``uniform_count``, learnt once), a push appends by
    concatenation and holds exactly what the general push holds (rows, positions, counts, dtypes); segments that
    differ give ``None`` and the general push; any other edit forgets the count."""
    gen = torch.Generator().manual_seed(seed)
    D = 3
    x = torch.randn(1, S, first, D, generator=gen)
    mask = torch.ones(1, S, first, dtype=torch.bool)
    if ragged and first:
        mask[0, 0, 0] = False
    pos = torch.arange(first).expand(1, S, first).int()
    fast, slow = Residual.from_mask(x, mask, pos), Residual.from_mask(x, mask, pos)
    even = fast.uniform_count()
    assert even == (None if ragged and first and S > 1 else int(mask[0, 0].sum()))
    at = first
    for n in pushes:
        rows = torch.randn(S, n, D, generator=gen)
        p = (at + torch.arange(n)).expand(S, n)
        fast.push(rows, p)
        slow._even = None  # the general push
        slow.push(rows, p)
        at += n
        for a, b in ((fast.rows, slow.rows), (fast.pos, slow.pos), (fast.counts, slow.counts)):
            assert a.dtype == b.dtype and torch.equal(a, b)
    if even is not None:
        assert fast._even == even + sum(pushes)
    fast.pop_front(torch.ones(S, dtype=torch.long).clamp_max(fast.counts))
    assert fast._even is None  # forgotten until asked again


def test_uniform_count_reads_once_and_pushes_read_nothing():
    from kvcore import value_checks
    from kvcore.testing.host_reads import HostReads

    r = _empty(3, 4)
    r.push(torch.randn(3, 2, 4), torch.arange(2).expand(3, 2))
    r._even = None
    with value_checks(False), HostReads() as learn:
        assert r.uniform_count() == 2
    with value_checks(False), HostReads() as reads:
        for t in range(2, 6):
            r.push(torch.randn(3, 1, 4), torch.full((3, 1), t))
        assert r.uniform_count() == 6
    assert learn.total > 0 and reads.total == 0


def test_adding_units_with_padding_rows_counted_by_the_caller_stores_only_the_real_rows():
    """``real_rows`` (the caller's count of non-padding rows) stores the same rows in the same order as finding them
    by the padding mask: units whose last rows are padding (``pos = -1``), in several segments."""
    from kvcodec import UniformQuantizer
    from kvcodec.ragged import QuantUnits

    U, D = 4, 8
    g = torch.Generator().manual_seed(4)
    pos = torch.arange(5 * U).view(5, U).int()
    pos[1, 2:] = -1  # segment 0's partial last unit
    pos[4, 1:] = -1  # segment 1's
    seg = torch.tensor([0, 0, 1, 1, 1])
    q = UniformQuantizer(2, "channel", U).quantize(torch.randn(5, U, D, generator=g))
    by_mask, counted = (QuantUnits(UniformQuantizer(2, "channel", U), U) for _ in range(2))
    by_mask.add_quantized(q, seg, pos)
    counted.add_quantized(q, seg, pos, real_rows=int((pos >= 0).sum()))
    assert counted.nr == by_mask.nr == 5 * U - 5
    assert torch.equal(counted.codes[: counted.nr], by_mask.codes[: by_mask.nr])
    assert (
        counted.positions()[1].tolist()
        == by_mask.positions()[1].tolist()
        == [p for p in pos.flatten().tolist() if p >= 0]
    )
    assert counted.positions()[0].tolist() == by_mask.positions()[0].tolist()
