"""HEXStore against the spec's properties P7-P9 (HEX §3.3-§3.5, §4.1), exact bytes, and clear errors."""

import math

import pytest
import torch

import kv_hex
from kv_hex import HEXConfig, HEXSelector, HEXStore, hex_tiers
from kv_hex.expander import dense_mask, expander_mask
from kvcore import EVICT, FULL, Budget, Plan, Scores, ScoringContext


def layer(B=1, H=3, T=192, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g)
    v = torch.randn(B, H, T, D, generator=g)
    k[..., 5] *= 8  # an outlier channel, as real keys have
    return k.to(dtype), v.to(dtype), torch.arange(T).expand(B, T)


def hex_plan(cfg, T, B=1, H=3, scores=None):
    s = torch.zeros(B, H, T) if scores is None else scores
    keep = torch.ones(B, H, T, dtype=torch.bool)
    return Plan(hex_tiers(s, keep, torch.zeros_like(keep), cfg.bits, cfg.heavy_ratio, cfg.recent, cfg.block_size))


# -- P7: heavy hitters ------------------------------------------------------------------------------------------
def test_heavy_hitters_same_for_every_head_with_lower_index_ties():
    """With HEX's global score the selector picks one token set for every head; equal scores favour lower indices;
    the last r tokens of the segment and the residual are FULL."""
    sel = HEXSelector(bits=3, heavy_ratio=0.05, recent=8, block_size=96)
    s = torch.zeros(1, 2, 200)
    s[..., 50] = 5.0
    s[..., 120] = 5.0  # a tie: both taken (5 % of 192 = 9 heavy hitters), then the lowest indices
    plan = sel.select(Scores(s), Budget(ratio=0.0))
    full = plan.key_bits == FULL
    assert torch.equal(full[:, 0], full[:, 1]), "heavy hitters differ between heads"
    want = torch.zeros(200, dtype=torch.bool)
    want[[50, 120, 0, 1, 2, 3, 4, 5, 6]] = True  # 9 = int(0.05 * 192)
    want[184:192] = True  # recent window: last 8 of the compressed segment
    want[192:] = True  # residual: 200 mod 96 = 8 slots
    assert torch.equal(full[0, 0], want)
    assert set(plan.key_bits.unique().tolist()) == {3, FULL}


def test_scorer_makes_heavy_hitters_global_through_the_compressor():
    """Through hex(3): a token that draws all of one head's attention is FULL in every head (HEX's global
    selection), and a compressor with per-head scores would not make it so."""
    B, H, T, D = 1, 2, 96, 16
    k, v, _pos = layer(B, H, T, D, seed=3)
    k[0, 0, 40] = 30 * torch.ones(D)  # head 0 attends to token 40
    q = torch.ones(B, 4, T, D)
    ctx = ScoringContext(keys=k, values=v, queries=q)
    comp = kv_hex.hex(3, recent=0, heavy_ratio=0.02)  # 1 heavy hitter per 96 tokens
    plan = comp.plan(ctx)
    assert bool((plan.key_bits[0, :, 40] == FULL).all()), "the heavy hitter must be kept in every head"
    assert int((plan.key_bits == FULL).sum()) == H


# -- P8: precision ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value_scope", ["layer", "head"])
@pytest.mark.parametrize("bits", [3, 4])
def test_full_precision_exact_and_codes_within_half_a_step(bits, value_scope):
    """FULL rows and overlay elements read back bit-exact; every other element is within Δ_g/2 of its value, with
    Δ_g = (max - min)/(2^b - 1) over its group's entries *not* kept in full precision: keys per (head, channel) over
    the segment's coded tokens, values per token over every head's coded channels (``layer``) or one head's."""
    cfg = HEXConfig(bits=bits, value_scope=value_scope)
    k, v, pos = layer()
    plan = hex_plan(cfg, 192)
    store = HEXStore(cfg)
    store.write(k, v, plan, pos)
    view = store.read()
    assert torch.equal(view.positions[0, 0], torch.arange(192))
    full = plan.key_bits == FULL  # [1, 3, 192]
    emask = torch.from_numpy(dense_mask(expander_mask(192, 192, cfg.rho))).view(192, 3, 64).permute(1, 0, 2)[None]
    exact = full[..., None] | emask
    assert torch.equal(view.keys[exact], k[exact]) and torch.equal(view.values[exact], v[exact])
    coded = ~exact
    levels = 2**bits - 1

    def group_step(x, dims):
        lo = torch.where(coded, x, math.inf).amin(dims, keepdim=True)
        hi = torch.where(coded, x, -math.inf).amax(dims, keepdim=True)
        return (hi - lo) / levels

    dk = group_step(k, (2,)).expand_as(k)  # keys: per (b, h, channel) over tokens
    dims = (1, 3) if value_scope == "layer" else (3,)
    dv = group_step(v, dims).expand_as(v)
    for got, want, d in ((view.keys, k, dk), (view.values, v, dv)):
        err = (got - want).abs()[coded]
        assert bool((err <= d[coded] / 2 * (1 + 1e-5) + 1e-6).all())


def test_masked_statistics_never_widen_a_group():
    """P8: statistics over the unmasked entries give Δ_g^HEX <= Δ_g^KCVT for every group (same tiers, same bits)."""
    k, v, pos = layer()
    cfg = HEXConfig(bits=3, heavy_ratio=0.0, recent=0)
    plan = hex_plan(cfg, 192)
    a, b = HEXStore(cfg), HEXStore(HEXConfig(bits=3, heavy_ratio=0.0, recent=0, mask_kind="none"))
    a.write(k, v, plan, pos)
    b.write(k, v, plan, pos)
    sa, sb = a._segments[0], b._segments[0]
    assert bool((sa.k_scale <= sb.k_scale).all()) and bool((sa.v_scale <= sb.v_scale).all())
    assert bool((sa.k_scale < sb.k_scale).any()), "the outlier channel's range shrinks when its outliers are masked"
    err = lambda s: ((s.read().keys - k).abs().mean(), (s.read().values - v).abs().mean())  # noqa: E731
    assert err(a)[0] < err(b)[0] and err(a)[1] < err(b)[1]


# -- P9: streaming ----------------------------------------------------------------------------------------------
def segment_bytes(seg):
    return {
        name: t.clone()
        for name, t in vars(seg).items()
        if isinstance(t, torch.Tensor)  # every tensor the segment holds
    }


def test_append_mode_never_changes_earlier_segments_and_residual_stays_short():
    """Residual = L mod n_b after prefill, < n_b after every append; earlier segments' tensors are bit-identical
    after any number of appends; each full block becomes a new segment."""
    cfg = HEXConfig(bits=3, block_size=16, recent=2, heavy_ratio=0.1, rho=0.125)
    k, v, pos = layer(B=2, H=2, T=37, D=16)
    store = HEXStore(cfg)
    store.write(k, v, hex_plan(cfg, 37, B=2, H=2), pos)
    assert store.residual_lengths().tolist() == [[5, 5], [5, 5]]
    first = segment_bytes(store._segments[0])
    g = torch.Generator().manual_seed(1)
    for step in range(40):
        q = torch.randn(2, 4, 1, 16, generator=g)
        store.attend(q)
        new = torch.randn(2, 2, 1, 16, generator=g)
        store.append(new, new * 2, torch.full((2, 1), 37 + step))
        assert bool((store.residual_lengths() < 16).all())
        now = segment_bytes(store._segments[0])
        assert all(torch.equal(first[n], now[n]) for n in first), "append changed an earlier segment"
    assert len(store._segments) == 1 + (5 + 40) // 16
    assert store.seq_lengths().tolist() == [[77, 77], [77, 77]]


def test_decode_blocks_keep_the_most_attended_token():
    """At a block end the heavy hitter is the token that drew the most attention through attend() (summed over
    heads and steps), kept FULL in every head; the last ``recent`` tokens are FULL too."""
    cfg = HEXConfig(bits=3, block_size=8, heavy_ratio=0.125, recent=1, rho=0.25)
    store = HEXStore(cfg)
    D = 8
    for t in range(8):
        key = torch.zeros(1, 2, 1, D)
        if t == 2:
            key[..., 0] = 10.0  # queries along channel 0 attend here
        store.append(key, torch.randn(1, 2, 1, D), torch.tensor([[t]]))
        q = torch.zeros(1, 2, 1, D)
        q[..., 0] = 1.0
        if t < 7:
            store.attend(q)
    tiers = store.tiers().key_bits[0]
    assert store.residual_lengths().tolist() == [[0, 0]]
    assert bool((tiers[:, 2] == FULL).all()) and bool((tiers[:, 7] == FULL).all())
    assert int((tiers == FULL).sum()) == 4  # 1 heavy hitter + 1 recent, in each of 2 heads


def test_full_mode_equals_one_shot_compression_of_the_held_cache():
    """Full mode at a block end = one HEX compression (one segment, mask over all n tokens) of what was held
    (the reconstruction of earlier segments + the new block), P9 / spec A10."""
    cfg = HEXConfig(bits=3, block_size=16, recent=2, heavy_ratio=0.1, rho=0.125, mode="full")
    k, v, pos = layer(B=1, H=2, T=32, D=16)
    store = HEXStore(cfg)
    store.write(k, v, hex_plan(cfg, 32, H=2), pos)
    held = store.read()
    g = torch.Generator().manual_seed(2)
    nk, nv = torch.randn(1, 2, 16, 16, generator=g), torch.randn(1, 2, 16, 16, generator=g)
    store.append(nk, nv, torch.arange(32, 48)[None])
    assert len(store._segments) == 1 and store._segments[0].n == 48
    once = HEXStore(HEXConfig(bits=3, block_size=48, recent=2, heavy_ratio=0.1, rho=0.125))
    K, V = torch.cat([held.keys, nk], 2), torch.cat([held.values, nv], 2)
    once.write(K, V, hex_plan(once.config, 48, H=2), torch.arange(48)[None])
    a, b = store.read(), once.read()
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(store.tiers().key_bits, once.tiers().key_bits)


# -- bytes ------------------------------------------------------------------------------------------------------
def test_nbytes_is_the_sum_of_the_parts_for_hex3_on_fp16():
    """HEX-3 on one 192-token fp16 layer of 3 KV heads × 64 (SmolLM2's shape), counted from the paper's layout
    independently of the store: codes, full rows, overlay values, KCVT statistics, positions and bookkeeping."""
    k, v, pos = layer(dtype=torch.float16)
    cfg = HEXConfig(bits=3)
    store = HEXStore(cfg)
    store.write(k, v, hex_plan(cfg, 192), pos)
    H, T, D = 3, 192, 64
    full_tokens = int(0.02 * T) + 8
    coded_tokens = T - full_tokens
    d1 = round(0.03125 * H * D)  # overlay elements per coded token, over its heads
    want = 2 * (
        coded_tokens * H * (D * 3 // 8)  # packed 3-bit codes
        + full_tokens * H * D * 2  # fp16 rows
        + coded_tokens * d1 * 2  # overlay values
    )
    want += H * D * 2 * 2 + T * 2 * 2  # key scale/zero per (head, channel); value scale/zero per token (fp16)
    want += T * H * 2 + T * 2  # int16 positions per entry and int16 slot positions per token (all <= 32,767)
    want += 2 * -(-T * H // 8)  # key / value FULL flags (one bit per entry)
    want += 2 * H * 8 + 8  # per-head counts of the segment and the (empty) residual; last position of the row
    assert store.nbytes() == want
    rep = store.memory_report()
    assert rep["fp16_bytes"] == 2 * T * H * D * 2
    assert rep["fraction_of_fp16"] == pytest.approx(want / (2 * T * H * D * 2))
    assert 0.2 < rep["payload_fraction_of_fp16"] < rep["fraction_of_fp16"] < 0.32


# -- errors -----------------------------------------------------------------------------------------------------
def test_bad_input_is_refused_and_changes_nothing():
    cfg = HEXConfig(bits=3, block_size=8)
    k, v, pos = layer(H=2, T=16, D=8)
    store = HEXStore(cfg)
    store.write(k, v, hex_plan(cfg, 16, H=2), pos)
    before, size = store.read().keys.clone(), store.nbytes()
    nan = k.clone()
    nan[0, 0, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="keys"):
        store.write(nan, v, hex_plan(cfg, 16, H=2), pos)
    with pytest.raises(ValueError, match="values"):
        store.append(k[:, :, :1], torch.full_like(v[:, :, :1], float("inf")), torch.tensor([[16]]))
    with pytest.raises(ValueError, match="full_precision"):
        fp = torch.zeros(1, 2, 16, 8, dtype=torch.bool)
        store.write(k, v, Plan(hex_plan(cfg, 16, H=2).key_bits, None, fp), pos)
    with pytest.raises(ValueError, match=r"plan.key_bits uses tiers \[4\]; this HEXStore holds"):
        store.write(k, v, Plan(torch.where(torch.rand(1, 2, 16) > 0.5, 4, 16).to(torch.uint8)), pos)
    with pytest.raises(TypeError, match="config"):
        HEXStore({"bits": 3})
    assert torch.equal(store.read().keys, before) and store.nbytes() == size
    assert EVICT in store.supported_bits and 3 in store.supported_bits and 4 not in store.supported_bits


def test_positions_widen_past_int16_and_stay_exact():
    """Positions are held in int16 while every one is at most 32,767 (segments and residual); a write or append at a
    larger position holds int32, and reads, crops (a Python int beyond int16) and attention see the true ones."""
    from kvcore import reference_attention

    cfg = HEXConfig(bits=3)
    k, v, _ = layer(T=192)
    start = 32_573  # the prefill ends at 32,764; the appends cross the boundary
    pos = torch.arange(start, start + 192)[None]
    store = HEXStore(cfg)
    store.write(k, v, hex_plan(cfg, 192), pos)
    assert store._segments[0].pos.dtype == torch.int16 and store._segments[0].slot_pos.dtype == torch.int16
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        p = start + 192 + step
        store.append(torch.randn(1, 3, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g), torch.tensor([[p]]))
    want = list(range(start, start + 196))
    assert store._res["pos"].dtype == torch.int32  # widened by the append at 32,768
    view = store.read()
    assert view.positions[0, 0].tolist() == want
    q = torch.randn(1, 3, 1, 64, generator=g)
    torch.testing.assert_close(store.attend(q)[0], reference_attention(view, q)[0], rtol=1e-4, atol=1e-4)
    store.crop(32_768)
    assert store.read().positions[0, 0].tolist() == [p for p in want if p < 32_768]
    low = HEXStore(cfg)
    low.write(k, v, hex_plan(cfg, 192), torch.arange(192)[None])
    assert low._segments[0].pos.dtype == torch.int16 and low._res["pos"].dtype == torch.int16
    high = HEXStore(cfg)  # a segment past int16: its entry and slot positions are int32 and read back exact
    high.write(k, v, hex_plan(cfg, 192), torch.arange(40_000, 40_192)[None])
    assert high._segments[0].pos.dtype == torch.int32 and high._segments[0].slot_pos.dtype == torch.int32
    assert high.read().positions[0, 0].tolist() == list(range(40_000, 40_192))
    torch.testing.assert_close(high.attend(q)[0], reference_attention(high.read(), q)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["append", "full"])
def test_decode_without_value_checks_reads_only_at_block_ends(mode, monkeypatch):
    """With the per-step value checks off (an accelerator's default) a decode step reads nothing on the host unless
    it fills a block or follows one (a new segment's longest head is read once): the residual's distinct positions
    per batch row are counted on the host and bound the fused path's ``T``; the store ends bit-identical to one
    decoded with the checks on, flushes included."""
    from kv_hex.kernels import dispatch
    from kvcore import value_checks
    from kvcore.testing.host_reads import HostReads

    cfg = HEXConfig(bits=3, block_size=16, recent=2, heavy_ratio=0.1, rho=0.125, mode=mode)
    k, v, pos = layer(B=2, H=2, T=37, D=16)
    checked, unchecked = HEXStore(cfg), HEXStore(cfg)
    for store in (checked, unchecked):
        store.write(k, v, hex_plan(cfg, 37, B=2, H=2), pos)
    monkeypatch.setattr(dispatch, "use_triton", lambda t: True)  # the fused path (the interpreter computes it)
    g = torch.Generator().manual_seed(1)
    quiet = 0
    for step in range(20):
        q = torch.randn(2, 4, 1, 16, generator=g)
        new = torch.randn(2, 2, 1, 16, generator=g)
        p = torch.full((2, 1), 37 + step)
        out = checked.attend(q)
        checked.append(new, new * 2, p)
        with value_checks(False), HostReads(sites=True) as reads:
            again = unchecked.attend(q)
            unchecked.append(new, new * 2, p)
        torch.testing.assert_close(again, out, rtol=0, atol=0)
        fills, after = (5 + step + 1) % 16 == 0, (5 + step) % 16 == 0
        if step and not (fills or after):  # the first step learns the distinct positions (the write left them unknown)
            assert reads.total == 0, (step, dict(reads.by_site))
            quiet += 1
    assert quiet >= 16
    a, b = checked.read(), unchecked.read()
    for x, y in zip((a.keys, a.values, a.positions), (b.keys, b.values, b.positions)):
        assert torch.equal(x, y)
    assert unchecked._res["pos"].dtype == torch.int32 and checked._res["pos"].dtype == torch.int16
