"""KIVIStore's decode layout (kv_baselines.quant.kivi_decode): the same entries, bit for bit, as the flat layout;
attend over it equals reference attention; a bounded reserve counted in nbytes(); all-or-nothing appends."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_baselines.quant import KIVIStore, UniformQuantizer, kivi_decode, kivi_store, kivi_tiers
from kvcore import Plan, reference_attention


def _written(seed, bits=2, B=1, H=3, T=40, D=16, G=4, R=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    store = KIVIStore(UniformQuantizer(bits, "channel", G), UniformQuantizer(bits, "token", G), residual=R)
    keep = torch.ones(B, H, T, dtype=torch.bool)
    plan = Plan(kivi_tiers(keep, bits, R, "keys"), kivi_tiers(keep, bits, R, "values"))
    k, v = torch.randn(B, H, T, D, generator=gen), torch.randn(B, H, T, D, generator=gen)
    store.write(k.to(dtype), v.to(dtype), plan, torch.arange(T).expand(B, T))
    return store, gen


def _append(store, gen, n, start):
    B, H, D = store._shape
    k, v = torch.randn(B, H, n, D, generator=gen), torch.randn(B, H, n, D, generator=gen)
    store.append(k.to(store._dtype), v.to(store._dtype), torch.arange(start, start + n).expand(B, n))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    bits=st.sampled_from([1, 2, 4, 8]),
    sizes=st.lists(st.integers(1, 11), min_size=1, max_size=8),
    B=st.integers(1, 2),
    H=st.sampled_from([1, 3]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_decode_layout_holds_the_flat_layouts_entries_bit_for_bit(seed, bits, sizes, B, H, dtype, monkeypatch_flat):
    """Invariant: appends through the decode layout (single tokens, several at once, key blocks flushed, the value
    FIFO turning) leave exactly the codes, scales, zeros, full-precision rows and positions the flat layout builds:
    read(), tiers(), entry counts and every tensor of the flat sides are identical, in every cache dtype."""
    fast, gen_f = _written(seed, bits, B=B, H=H, dtype=dtype)
    with monkeypatch_flat():
        flat, gen_s = _written(seed, bits, B=B, H=H, dtype=dtype)
    start = 40
    for n in sizes:
        _append(fast, gen_f, n, start)
        with monkeypatch_flat():
            _append(flat, gen_s, n, start)
        start += n
    assert fast._dec is not None and flat._dec is None
    assert torch.equal(fast.seq_lengths(), flat.seq_lengths())
    counts = fast.entry_counts()
    assert all(torch.equal(counts[k], v) for k, v in flat.entry_counts().items())
    a, b = fast.read(), flat.read()  # read() turns the decode layout back into the flat one
    assert fast._dec is None
    for x, y in zip((a.keys, a.values, a.positions, a.logit_bias), (b.keys, b.values, b.positions, b.logit_bias)):
        assert torch.equal(x, y)
    assert torch.equal(fast.tiers().key_bits, flat.tiers().key_bits)
    for kind in ("k", "v"):
        x, y = fast._sides[kind], flat._sides[kind]
        for name in ("codes", "scales", "zeros", "usize", "ucount", "qcount", "resid", "rcount"):
            u, w = getattr(x, name), getattr(y, name)
            assert (u is None and w is None) or (torch.equal(u, w) and u.dtype == w.dtype), (kind, name)
            assert u is None or u.is_contiguous(), (kind, name)  # the flat layout's kernels take contiguous rows
    assert fast._pos.pos.dtype == flat._pos.pos.dtype and torch.equal(fast._pos.pos, flat._pos.pos)


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    bits=st.sampled_from([2, 4]),
    steps=st.integers(1, 20),
    Q=st.integers(1, 2),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_attend_over_the_decode_layout_equals_reference_over_read(seed, bits, steps, Q, dtype):
    """Invariant: attend() over the decode layout (lane-shifted unpack, in-place key dequantization, value scales
    folded into the attention weights, the FIFO ring rotated) equals reference attention over the dequantized
    read(), at KIVI's shapes (d 64, G 32) and small ones. Half-precision caches: the decode layout computes in
    float32 from the codes, ``read()`` rounds every dequantized entry to the cache dtype first, so the tolerance is
    that rounding's (a relative 2^-8 for bfloat16, 2^-11 for float16, on entries of magnitude ~3)."""
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}[dtype]
    for D, G, R in ((64, 32, 32), (16, 4, 8)):
        store, gen = _written(seed, bits, T=3 * R + 5, D=D, G=G, R=R, dtype=dtype)
        for i in range(steps):
            _append(store, gen, 1, 3 * R + 5 + i)
        assert store._dec is not None
        q = torch.randn(1, 6, Q, D, generator=gen)
        out, lse = store.attend(q, 0.2)
        ref_out, ref_lse = reference_attention(store.read(), q, 0.2)
        assert torch.allclose(out, ref_out, atol=tol, rtol=tol)
        assert torch.allclose(lse, ref_lse, atol=tol, rtol=tol)


def test_the_reserve_is_bounded_and_counted():
    # SmolLM2's layer shape at 2k tokens: nbytes() counts the decode layout's reserve (more than the packed entries
    # and their positions) and stays within 3% of the theoretical packed size; a step that fits in the reserve
    # writes in place
    B, H, T, D, G, R = 1, 3, 2048, 64, 32, 128
    store, gen = _written(0, 2, B=B, H=H, T=T, D=D, G=G, R=R)
    _append(store, gen, 1, T)
    dec = store._dec
    ptrs = (dec.vc.data_ptr(), dec.vs.data_ptr(), dec.pos.data_ptr(), dec.ring.data_ptr(), dec.kr.data_ptr())
    _append(store, gen, 1, T + 1)
    assert (dec.vc.data_ptr(), dec.vs.data_ptr(), dec.pos.data_ptr(), dec.ring.data_ptr(), dec.kr.data_ptr()) == ptrs
    c = {k: int(v.sum()) for k, v in store.entry_counts().items()}
    packed = (
        c["keys_quantized"] * D // 4  # 2-bit codes
        + c["keys_quantized"] // G * D * 2 * 4  # a float32 scale and zero per channel and key group
        + c["values_quantized"] * (D // 4 + D // G * 2 * 4)
        + (c["keys_full"] + c["values_full"]) * D * 4
    )
    positions = B * (T + 2) * 2  # int16, shared by the heads of a row
    assert packed + positions < store.nbytes() <= 1.03 * packed
    assert kivi_decode.reserve(T) == 16 and kivi_decode.reserve(128 * 100) == 100


def test_failed_appends_change_nothing_in_the_decode_layout():
    store, gen = _written(3, 2, T=40, D=16, G=4, R=8)
    _append(store, gen, 1, 40)
    B, H, D = store._shape
    huge = torch.full((B, H, 1, D), 3e38)
    huge[..., ::2] = -3e38  # finite, but its range overflows a float32 scale once it leaves the FIFO
    store.append(torch.randn(B, H, 1, D, generator=gen), huge, torch.tensor([[41]]))
    pos = 42
    with pytest.raises(ValueError, match="too large"):
        for _ in range(9):
            _append(store, gen, 1, pos)
            pos += 1
    assert store._dec is not None
    before = store.nbytes(), store.seq_lengths().clone(), store.entry_counts()
    q = torch.randn(1, 3, 1, D)
    out = store.attend(q)[0]
    for bad in (
        lambda: _append(store, gen, 1, pos),  # the overflowing row is still the oldest
        lambda: store.append(torch.zeros(B, H, 1, D), torch.zeros(B, H, 1, D), torch.tensor([[pos - 5]])),
        lambda: store.append(torch.full((B, H, 1, D), math.nan), torch.zeros(B, H, 1, D), torch.tensor([[pos]])),
    ):
        with pytest.raises(ValueError):
            bad()
        assert store.nbytes() == before[0] and torch.equal(store.seq_lengths(), before[1])
        assert all(torch.equal(store.entry_counts()[k], v) for k, v in before[2].items())
        assert torch.equal(store.attend(q)[0], out)


@pytest.fixture
def monkeypatch_flat(monkeypatch):
    """A context in which KIVIStore never enters the decode layout (the flat layout's own append)."""
    import contextlib

    @contextlib.contextmanager
    def flat():
        with monkeypatch.context() as m:
            m.setattr(kivi_store, "eligible", lambda *a: False)
            yield

    return flat


def test_appends_without_value_checks_read_nothing_on_the_host():
    """With the per-step value checks off (an accelerator's default) a decode-layout append reads nothing on the
    host but the value flush's scale rounding, which reads only on the CPU (kv_baselines.quant.token_quant._scale),
    and, once per ``R`` appends, the key-block quantizer's own checks (``UniformQuantizer.quantize``); the positions
    are then held in int32, and read() is unchanged otherwise."""
    from kvcore import value_checks
    from kvcore.testing.host_reads import HostReads

    checked, unchecked = _written(5, 2, T=80, D=64, G=32, R=32), _written(5, 2, T=80, D=64, G=32, R=32)
    for store, gen in (checked, unchecked):
        _append(store, gen, 1, 80)
        assert store._dec is not None
    with value_checks(False), HostReads(sites=True) as reads:
        for i in range(40):  # the value FIFO turns and a key block is flushed
            _append(*unchecked, 1, 81 + i)
    for i in range(40):
        _append(*checked, 1, 81 + i)
    per_step = sum(n for (site, _), n in reads.by_site.items() if "token_quant" in site and "_scale" in site)
    assert per_step == 40, dict(reads.by_site)  # one per value flush, on the CPU only
    assert reads.total - per_step <= 2 * (40 // 32 + 1), dict(reads.by_site)  # key blocks: finite, scales finite
    assert unchecked[0]._dec.pos.dtype == torch.int32 and checked[0]._dec.pos.dtype == torch.int16
    a, b = checked[0].read(), unchecked[0].read()
    for x, y in zip((a.keys, a.values, a.positions), (b.keys, b.values, b.positions)):
        assert torch.equal(x, y)
