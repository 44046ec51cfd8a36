"""The CPU decode path over a HEX part read in place (kv_hex.segment_attention) against the reference over the
part's layout (kv_hex.kernels.reference): the same dequantized rows bit for bit, the same attention, and the
reference taken exactly where a segment is not one block per head."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_hex import HEXConfig, HEXStore, hex_tiers, segment_attention
from kv_hex.kernels import reference
from kv_hex.layout import residual_layout, segment_layout
from kvcore import EVICT, Plan


@st.composite
def stores(draw):
    """A HEXStore holding one written segment (and a residual) with a random shape, code width, value grouping,
    mask, dtype and per-head random heavy hitters (so heads may hold different numbers of full rows); ``evict``:
    none, one slot in every head (every head one entry shorter than the segment's slots) or, with several heads,
    half of one head's entries (ragged heads)."""
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    cfg = HEXConfig(
        bits=bits,
        block_size=draw(st.integers(4, 12)),
        recent=draw(st.integers(0, 2)),
        heavy_ratio=draw(st.sampled_from([0.0, 0.1, 0.3])),
        rho=0.125,
        value_scope=draw(st.sampled_from(["layer", "head"])),
        mask_scope=draw(st.sampled_from(["layer", "head"])),
        mask_kind=draw(st.sampled_from(["expander", "random", "none"])),
    )
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    D = draw(st.sampled_from([8, 16]))
    T = draw(st.integers(cfg.block_size, 3 * cfg.block_size + 3))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    k = (torch.randn(B, H, T, D, generator=g) * 2).to(dtype)
    v = torch.randn(B, H, T, D, generator=g).to(dtype)
    keep = torch.ones(B, H, T, dtype=torch.bool)
    tiers = hex_tiers(torch.rand(B, H, T, generator=g), keep, torch.zeros_like(keep), bits, cfg.heavy_ratio,
                      cfg.recent, cfg.block_size)  # fmt: skip
    evict = draw(st.sampled_from(["none", "slot", "ragged"] if B * H > 1 else ["none", "slot"]))
    if evict == "slot":
        tiers[:, :, draw(st.integers(0, T - 1))] = EVICT
    elif evict == "ragged":
        tiers[0, 0, ::2] = EVICT
    store = HEXStore(cfg)
    store.write(k, v, Plan(tiers), torch.arange(T).expand(B, T))
    return store, evict


def uniform(seg) -> bool:
    return bool((seg.counts == seg.counts[0]).all()) and seg.num_entries > 0


@settings(max_examples=60, deadline=None)
@given(stores(), st.integers(1, 3), st.integers(1, 2), st.booleans())
def test_segment_attention_equals_the_reference_over_the_layout(case, G, Q, logits):
    """out, lse and (with logits=True) every entry's logits, in entry order, equal the reference's; the segment's
    dequantized rows are the reference's bit for bit; a segment with one block per head takes the in-place path
    (no layout built), any other the reference."""
    store, evict = case
    seg = store._segments[0]
    assert (evict == "ragged") == (not uniform(seg)) or seg.num_entries == 0
    B, H, D = store._shape
    q = torch.randn(B, H * G, Q, D, generator=torch.Generator().manual_seed(1)).to(seg.k_rows.dtype)
    layout = segment_layout(store.config, seg)
    want = reference.part_attention(q, layout, 0.3, logits)
    built = []
    real = segment_attention.segment_layout

    def spy(cfg, s):
        built.append(s)
        return real(cfg, s)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(segment_attention, "segment_layout", spy)
        got = segment_attention.segment_attention(q, store.config, seg, 0.3, logits)
    assert bool(built) == (not uniform(seg))
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if logits:
        torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-5)
    else:
        assert got[2] is None
    if uniform(seg) and seg.coded:
        S, T = seg.counts.numel(), int(seg.counts[0])
        slot = None if seg.n == T else seg.slots().view(S, T)
        want_k, want_v = reference.dequantize_part(layout)
        for kind, rows in (("k", want_k), ("v", want_v)):
            if not getattr(seg, f"{kind}_full").numel():
                continue
            maps = segment_attention._entry_maps(store.config, seg, kind, T, slot)
            got_rows = segment_attention._dequantized(store.config, seg, kind, T, slot, maps)
            assert got_rows.dtype == rows.dtype and torch.equal(got_rows.view(-1, D), rows)


@settings(max_examples=30, deadline=None)
@given(stores(), st.integers(1, 3))
def test_residual_attention_equals_the_reference_over_its_layout(case, G):
    store, _ = case
    B, H, D = store._shape
    res = store._res
    if res["pos"].numel() == 0:
        res = dict(res)  # nothing in the residual: append a few tokens to a fresh one
        x = torch.randn(B, H, 3, D).to(store._dtype)
        fresh = HEXStore(store.config)
        fresh.append(x, x, torch.arange(3).expand(B, 3))
        res = fresh._res
    q = torch.randn(B, H * G, 2, D, generator=torch.Generator().manual_seed(2)).to(store._dtype)
    want = reference.part_attention(q, residual_layout(res, B, H, D, store.config.bits), 0.5, True)
    got = segment_attention.residual_attention(q, res, B, H, store.config.bits, 0.5, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_store_written_by_hex_attends_in_place_every_step(monkeypatch):
    """HEX's own plans give one block per head (heavy hitters global across heads, recent tokens whole): decoding
    through several block ends never builds a layout on the CPU path."""
    import kv_hex

    comp = kv_hex.hex(3)
    cfg = HEXConfig(block_size=16, rho=0.125)
    B, H, T, D = 1, 3, 70, 16
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    from kvcore import Scores

    plan = comp.selector.select(Scores(torch.rand(B, 1, T, generator=g).expand(B, H, T)), comp.budget)
    store = HEXStore(cfg)
    store.write(k, v, Plan(plan.key_bits), torch.arange(T)[None])
    monkeypatch.setattr(segment_attention, "segment_layout", lambda *a: pytest.fail("built a layout"))
    monkeypatch.setattr(segment_attention, "residual_layout", lambda *a: pytest.fail("built a layout"))
    for step in range(40):
        x = torch.randn(B, H, 1, D, generator=g)
        store.append(x, x, torch.tensor([[T + step]]))
        store.attend(torch.randn(B, 2 * H, 1, D, generator=g))
    assert len(store._segments) >= 3


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from([2, 3, 4, 8]),
    st.sampled_from(["layer", "head"]),
    st.sampled_from(["expander", "random", "none"]),
    st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    st.integers(1, 2),
    st.integers(1, 3),
    st.integers(2, 5),
    st.booleans(),
    st.integers(0, 2**16),
    st.sampled_from([5, 8]),
)
def test_stacked_decode_blocks_equal_the_reference_merged_block_by_block(
    bits, value_scope, mask_kind, dtype, B, H, blocks, logits, seed, n
):
    """Decode blocks of one size attended as one stack (stack_segments: the blocks as batch rows of one segment;
    flags concatenated as bytes, or re-packed when a block's entries do not fill whole bytes) give the attention of
    the reference over each block's layout merged by log-sum-exp, and each block's own logits."""
    from kvcore import merge_attention

    cfg = HEXConfig(bits=bits, block_size=n, recent=1, heavy_ratio=0.2, rho=0.125, value_scope=value_scope,
                    mask_kind=mask_kind)  # fmt: skip
    D = 16
    g = torch.Generator().manual_seed(seed)
    store = HEXStore(cfg)
    for t in range(n * blocks + 3):
        x = torch.randn(B, H, 1, D, generator=g).to(dtype)
        store.append(x, -x, torch.full((B, 1), t))
        store.attend(torch.randn(B, H, 1, D, generator=g).to(dtype))  # heavy hitters from real attention
    segs = store._segments
    assert len(segs) == blocks and all(segment_attention.stackable(s) == n for s in segs)
    q = torch.randn(B, 2 * H, 2, D, generator=g).to(dtype)
    want = [reference.part_attention(q, segment_layout(cfg, s), 0.4, logits) for s in segs]
    out, lse, lg = segment_attention.segments_attention(q, cfg, segs, 0.4, logits)
    want_out, want_lse = merge_attention([(o, l) for o, l, _ in want])
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    if logits:
        assert len(lg) == blocks
        for a, (_, _, b) in zip(lg, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    else:
        assert lg is None


@pytest.mark.parametrize("stack_tokens", [8, 20, 2048])
def test_attend_over_many_decode_blocks_in_stacks_of_bounded_size(monkeypatch, stack_tokens):
    """A long decode (a prompt segment, then 7 decode blocks of 8): attend equals reference attention over read()
    whatever the stack bound, which caps how many slots one CPU call dequantizes."""
    from kv_hex import store as store_module
    from kvcore import reference_attention

    monkeypatch.setattr(store_module, "_STACK_TOKENS", stack_tokens)
    cfg = HEXConfig(bits=3, block_size=8, recent=1, heavy_ratio=0.2, rho=0.125)
    g = torch.Generator().manual_seed(9)
    B, H, D = 1, 2, 16
    store = HEXStore(cfg)
    k = torch.randn(B, H, 21, D, generator=g)
    store.write(k, k * 0.5, Plan(torch.full((B, H, 21), 3, dtype=torch.uint8)), torch.arange(21)[None])
    calls = []  # (segments, slots) of every segment read: stacks and segments read on their own
    stacked, single = segment_attention.segments_attention, segment_attention.segment_attention

    def spy_stack(q, c, segs, scale, logits=False, stack=None):
        calls.append((len(segs), sum(s.n for s in segs)))
        return stacked(q, c, segs, scale, logits, stack)

    def spy_single(q, c, seg, scale, logits=False):
        calls.append((1, seg.n))
        return single(q, c, seg, scale, logits)

    monkeypatch.setattr(store_module, "segments_attention", spy_stack)
    monkeypatch.setattr(store_module, "segment_attention", spy_single)
    for t in range(21, 21 + 7 * 8 + 5):
        x = torch.randn(B, H, 1, D, generator=g)
        store.append(x, x, torch.tensor([[t]]))
        q = torch.randn(B, 2 * H, 1, D, generator=g)
        want = reference_attention(store.read(), q)
        calls.clear()
        out, lse = store.attend(q)
        torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, want[1], rtol=1e-5, atol=1e-5)
        assert all(m == 1 or slots <= stack_tokens for m, slots in calls), calls  # one segment: whatever its size
    assert len(store._segments) == 8
    blocks = [m for m, slots in calls if (m, slots) != (1, 21)]  # the 7 decode blocks: stacks of <= bound // 8
    assert sum(blocks) == 7 and max(blocks) == max(1, min(7, stack_tokens // 8)), calls
