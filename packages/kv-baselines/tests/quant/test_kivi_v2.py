"""KIVIStore on kvcore contract v2: tiers/retier (eviction of any entry, untouched bytes, all-or-nothing), the fused
attend, the unquantized-plan warning, and kivi(evict=...)."""

import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kv_baselines as kb
from kv_baselines.quant import KIVIStore, KIVIUnquantizedWarning, UniformQuantizer, kivi_tiers
from kvcodec.segments import segment_ids
from kvcore import EVICT, FULL, DenseStore, Plan, ScoringContext, reference_attention


def _filled(seed=0, B=2, H=2, T=29, D=8, G=4, R=8, bits=2, appends=6, dtype=torch.float32, evict=0.3):
    gen = torch.Generator().manual_seed(seed)
    store = KIVIStore(UniformQuantizer(bits, "channel", G), UniformQuantizer(bits, "token", G), residual=R)
    k, v = torch.randn(B, H, T, D, generator=gen).to(dtype), torch.randn(B, H, T, D, generator=gen).to(dtype)
    keep = torch.rand(B, H, T, generator=gen) >= evict
    plan = Plan(kivi_tiers(keep, bits, R, "keys"), kivi_tiers(keep, bits, R, "values"))
    store.write(k, v, plan, torch.arange(T).expand(B, T))
    for i in range(appends):
        store.append(
            torch.randn(B, H, 1, D, generator=gen).to(dtype),
            torch.randn(B, H, 1, D, generator=gen).to(dtype),
            torch.full((B, 1), T + i),
        )
    return store


def _held_bytes(store):
    """Packed code rows, group parameters and full rows per kind, keyed by (segment, position), for identity checks
    (read from the store's segment-major layout, :mod:`kv_baselines.quant.kivi_layout`)."""
    out = {}
    seg, pos = segment_ids(store._pos.count).tolist(), store._pos.flat().tolist()
    for kind, side in store._sides.items():
        prefix = store._prefix(side).tolist()
        pkeys = [(s, p) for s, p, f in zip(seg, pos, prefix) if f]
        rkeys = [(s, p) for s, p, f in zip(seg, pos, prefix) if not f]
        fm = side.prefix_full().tolist()
        qkeys = [k for k, f in zip(pkeys, fm) if not f]
        fkeys = [k for k, f in zip(pkeys, fm) if f]
        uid = side.unit_of_row().tolist()
        out[kind] = {
            "quant": {
                k: (side.codes[i].clone(), side.scales[u].clone(), side.zeros[u].clone())
                for i, (k, u) in enumerate(zip(qkeys, uid))
            },
            "full": {k: r.clone() for k, r in zip(fkeys, side.full)},
            "resid": {k: r.clone() for k, r in zip(rkeys, side.resid)},
        }
    return out


def test_tiers_are_laid_out_like_read_and_match_the_write_plan():
    B, H, T, R, G = 1, 2, 21, 8, 4
    keep = torch.rand(B, H, T, generator=torch.Generator().manual_seed(1)) > 0.2
    plan = Plan(kivi_tiers(keep, 2, R, "keys"), kivi_tiers(keep, 2, R, "values"))
    store = KIVIStore(UniformQuantizer(2, "channel", G), UniformQuantizer(2, "token", G), residual=R)
    store.write(torch.randn(B, H, T, 8), torch.randn(B, H, T, 8), plan, torch.arange(T)[None])
    tiers, view = store.tiers(), store.read()
    assert tiers.key_bits.shape == view.positions.shape
    assert torch.equal(tiers.key_bits != EVICT, view.valid)
    for h in range(H):  # the kept entries' tiers in position order are the plan's
        assert torch.equal(tiers.key_bits[0, h][view.valid[0, h]], plan.key_bits[0, h][keep[0, h]])
        assert torch.equal(tiers.value_bits[0, h][view.valid[0, h]], plan.value_bits[0, h][keep[0, h]])


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), frac=st.floats(0.0, 1.0))
def test_retier_evicts_exactly_and_leaves_kept_bytes_untouched(seed, frac):
    """Invariant: after retier, read() holds exactly the kept entries with the same values, the kept entries'
    codes/scales/zeros/full rows are bit-identical, and memory does not grow."""
    store = _filled(seed)
    view, tiers = store.read(), store.tiers()
    before, nbytes = _held_bytes(store), store.nbytes()
    drop = (torch.rand(view.positions.shape, generator=torch.Generator().manual_seed(seed + 1)) < frac) & view.valid
    new_k = torch.where(drop, EVICT, tiers.key_bits).to(torch.uint8)
    new_v = torch.where(drop, EVICT, tiers.value_bits).to(torch.uint8)
    store.retier(Plan(new_k, new_v))
    after = store.read()
    kept = view.valid & ~drop
    assert torch.equal(store.seq_lengths(), kept.sum(-1))
    for b in range(view.positions.shape[0]):
        for h in range(view.positions.shape[1]):
            n = int(kept[b, h].sum())
            assert torch.equal(after.positions[b, h, :n], view.positions[b, h][kept[b, h]])
            assert torch.equal(after.keys[b, h, :n], view.keys[b, h][kept[b, h]])
            assert torch.equal(after.values[b, h, :n], view.values[b, h][kept[b, h]])
    held = _held_bytes(store)
    for kind in held:
        for part in held[kind]:
            for key, val in held[kind][part].items():
                old = before[kind][part][key]
                if isinstance(val, tuple):
                    assert all(torch.equal(a, b) for a, b in zip(val, old))
                else:
                    assert torch.equal(val, old)
    assert store.nbytes() <= nbytes
    if frac == 1.0 or bool(drop.sum() == view.valid.sum()):
        assert int(store.seq_lengths().sum()) == 0


def test_retier_drops_a_code_row_inside_a_key_group_without_requantizing():
    store = _filled(3, B=1, H=1, T=16, appends=0, evict=0.0)  # keys: two quantized groups of 4 ... and residual
    units = store._sides["k"]
    rows_before, params = units.codes.shape[0], units.scales.clone()
    tiers = store.tiers()
    kb_ = tiers.key_bits.clone()
    kb_[0, 0, 1] = EVICT  # an entry of the first per-channel key group
    vb_ = tiers.value_bits.clone()
    vb_[0, 0, 1] = EVICT
    store.retier(Plan(kb_, vb_))
    units = store._sides["k"]  # mutations commit new sides (the old ones are left as they were)
    assert units.codes.shape[0] == rows_before - 1 and torch.equal(units.scales, params)


@pytest.mark.parametrize("case", ["up", "other_width", "padding", "mismatch", "shape"])
def test_retier_rejects_bad_plans_and_changes_nothing(case):
    store = _filled(5)
    view, tiers, nbytes = store.read(), store.tiers(), store.nbytes()
    kb_, vb_ = tiers.key_bits.clone(), tiers.value_bits.clone()
    quant = (kb_ == 2).nonzero()[0]
    if case == "up":
        kb_[tuple(quant)] = FULL
    elif case == "other_width":
        kb_[tuple(quant)] = 4
    elif case == "padding":
        pad = (~view.valid).nonzero()[0]
        kb_[tuple(pad)] = FULL
        vb_[tuple(pad)] = FULL
    elif case == "mismatch":
        kb_[tuple(quant)] = EVICT
    else:
        kb_, vb_ = kb_[..., :-1], vb_[..., :-1]
    with pytest.raises(ValueError, match="plan"):
        store.retier(Plan(kb_, vb_))
    after = store.read()
    assert (
        store.nbytes() == nbytes and torch.equal(after.keys, view.keys) and torch.equal(after.positions, view.positions)
    )


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("bits", [2, 4])
def test_attend_equals_reference_attention_over_read(group, bits):
    store = _filled(7, bits=bits)
    q = torch.randn(2, 2 * group, 2, 8, generator=torch.Generator().manual_seed(8))
    out, lse = store.attend(q, 0.4)
    ref_out, ref_lse = reference_attention(store.read(), q, 0.4)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # after eviction through retier, and with permanent full rows (FULL entries before quantized ones)
    tiers = store.tiers()
    drop = torch.zeros_like(tiers.key_bits, dtype=torch.bool)
    drop[0, 1, :5] = True
    drop &= tiers.key_bits != EVICT
    store.retier(
        Plan(
            torch.where(drop, EVICT, tiers.key_bits).to(torch.uint8),
            torch.where(drop, EVICT, tiers.value_bits).to(torch.uint8),
        )
    )
    out, lse = store.attend(q)
    ref_out, ref_lse = reference_attention(store.read(), q)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_attend_with_permanent_full_rows_and_empty_heads():
    B, H, T, D = 1, 2, 12, 8
    kb_ = torch.full((B, H, T), 2, dtype=torch.uint8)
    kb_[0, 0, :3] = FULL  # permanent full-precision rows before quantized entries
    kb_[0, 1] = EVICT  # an empty head
    store = KIVIStore(UniformQuantizer(2, "channel", 4), UniformQuantizer(2, "token", 4), residual=4)
    store.write(torch.randn(B, H, T, D), torch.randn(B, H, T, D), Plan(kb_), torch.arange(T)[None])
    q = torch.randn(B, 4, 1, D)
    out, lse = store.attend(q)
    ref_out, ref_lse = reference_attention(store.read(), q)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse)
    assert bool(torch.isinf(lse[0, 2:]).all())


def _to(x, device):
    """A segment (nested dataclasses of tensors) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if dataclasses.is_dataclass(x):
        return type(x)(**{f.name: _to(getattr(x, f.name), device) for f in dataclasses.fields(x) if f.init})
    return x


def test_attend_through_the_triton_kernel_matches():
    pytest.importorskip("triton")
    from kvcodec.kernels.reference import quantized_attention_ref
    from kvcodec.kernels.triton_attention import quantized_attention_triton

    store = _filled(11, B=1, H=2, T=13, appends=3)
    seg = store.quantized_segment()
    q = torch.randn(1, 4, 1, 8, generator=torch.Generator().manual_seed(12))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, the interpreter on CPU
    out, lse = (t.cpu() for t in quantized_attention_triton(q.to(device), _to(seg, device), 0.35, block_t=8))
    ref_out, ref_lse = reference_attention(store.read(), q, 0.35)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(quantized_attention_ref(q, seg, 0.35)[0], ref_out, rtol=1e-5, atol=1e-5)


def test_write_warns_when_a_long_plan_quantizes_nothing():
    store = KIVIStore(UniformQuantizer(2, "channel", 4), UniformQuantizer(2, "token", 4), residual=8)
    x = torch.randn(1, 1, 12, 8)
    with pytest.warns(KIVIUnquantizedWarning, match="KIVITierSelector"):
        store.write(x, x, Plan.from_keep(torch.ones(1, 1, 12, dtype=torch.bool)), torch.arange(12)[None])
    with warnings.catch_warnings():
        warnings.simplefilter("error", KIVIUnquantizedWarning)
        store.write(
            x[:, :, :8], x[:, :, :8], Plan.from_keep(torch.ones(1, 1, 8, dtype=torch.bool)), torch.arange(8)[None]
        )
        keep = torch.ones(1, 1, 12, dtype=torch.bool)
        store.write(
            x, x, Plan(kivi_tiers(keep, 2, 8, "keys"), kivi_tiers(keep, 2, 8, "values")), torch.arange(12)[None]
        )


def test_kivi_with_evict_quantizes_what_the_eviction_keeps():
    torch.manual_seed(0)
    B, H, T, D = 1, 2, 96, 16
    ctx = ScoringContext(
        keys=torch.randn(B, H, T, D),
        values=torch.randn(B, H, T, D),
        queries=torch.randn(B, 4, T, D),
        positions=torch.arange(T)[None],
    )
    evict = kb.snapkv(0.5, window=8)
    comp = kb.kivi(2, evict=evict, group_size=8, residual=16)
    store = comp.compress(ctx)
    dense = evict.compress(ctx)
    assert isinstance(store, KIVIStore) and isinstance(dense, DenseStore)
    assert torch.equal(store.seq_lengths(), dense.seq_lengths())  # same eviction
    assert torch.equal(store.read().positions, dense.read().positions)
    assert int(store.entry_counts()["keys_quantized"].sum()) > 0
    assert store.nbytes() < dense.nbytes()
    assert comp.budget == evict.budget and comp.protect == evict.protect and comp.scorer is evict.scorer
    legacy = kb.snapkv_kivi(0.5, bits=2, window=8, group_size=8, residual=16).compress(ctx)
    assert torch.equal(legacy.read().keys, store.read().keys)
    with pytest.raises(TypeError, match="evict"):
        kb.kivi(2, evict="snapkv")


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    bits=st.sampled_from([2, 3, 4]),
    dtype=st.sampled_from([torch.float32, torch.float16]),
    appends=st.integers(0, 12),
)
def test_attend_fast_path_equals_reference_over_read(seed, bits, dtype, appends):
    """Invariant: with equal-length heads (KIVI without eviction, the decode fast path: byte-lookup unpack, factorized
    per-channel logits and per-token value sums) attend equals reference attention over the dequantized read()."""
    store = _filled(seed, B=2, H=2, T=21, D=8, G=4, R=8, bits=bits, appends=appends, dtype=dtype, evict=0.0)
    assert store._fast()
    q = torch.randn(2, 4, 2, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out, lse = store.attend(q, 0.3)
    ref_out, ref_lse = reference_attention(store.read(), q, 0.3)
    assert torch.allclose(out, ref_out, atol=1e-4, rtol=1e-4)
    assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)


@settings(max_examples=10, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    bits=st.sampled_from([1, 2, 4]),
    appends=st.integers(0, 10),
    Q=st.integers(1, 3),
)
def test_attend_word_path_at_kivi_shapes_equals_reference_over_read(seed, bits, appends, Q):
    """Invariant: at KIVI's shapes (d = 64, G = 32: codes unpacked by 32-bit words,
    values flushed from the FIFO through the specialised per-token quantizer) attend equals reference attention over
    the dequantized read()."""
    store = _filled(seed, B=1, H=3, T=70, D=64, G=32, R=32, bits=bits, appends=appends, evict=0.0)
    assert store._fast() and store._sides["v"].codes.shape[0] > 0 and store._sides["k"].codes.shape[0] > 0
    q = torch.randn(1, 6, Q, 64, generator=torch.Generator().manual_seed(seed))
    out, lse = store.attend(q, 0.125)
    ref_out, ref_lse = reference_attention(store.read(), q, 0.125)
    assert torch.allclose(out, ref_out, atol=1e-4, rtol=1e-4)
    assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
