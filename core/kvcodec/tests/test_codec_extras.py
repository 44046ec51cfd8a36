"""Min-max statistics (grouped, whole-axis, masked), codebooks, and serialization."""

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec import CodebookQuantizer, UniformQuantizer, from_bytes, minmax_stats, normal_codebook, to_bytes
from kvcodec.serialize import FORMAT_VERSION
from kvcodec.uniform import quantize_minmax


def _loop_stats(x, axis, G, ignore):
    """Group min/max by plain loops over [T, D] (independent of the code under test)."""
    T, D = x.shape
    lo, hi, n = {}, {}, {}
    for t in range(T):
        for d in range(D):
            if ignore is not None and ignore[t, d]:
                continue
            key = (t, d // G) if axis == "token" else (t // G, d)
            v = float(x[t, d])
            lo[key], hi[key] = min(lo.get(key, v), v), max(hi.get(key, v), v)
            n[key] = n.get(key, 0) + 1
    return lo, hi, n


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 9),
    D=st.integers(1, 9),
    G=st.one_of(st.none(), st.integers(1, 10)),
    axis=st.sampled_from(["token", "channel"]),
    masked=st.booleans(),
    seed=st.integers(0, 999),
)
def test_minmax_stats_match_loops(T, D, G, axis, masked, seed):
    """Invariant: per group, lo/hi are the min/max of the group's unmasked entries (0/0 when all are masked)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    ignore = (torch.rand(T, D, generator=gen) < 0.3) if masked else None
    s = minmax_stats(x, axis, G, ignore)
    Gr = G if G is not None else (D if axis == "token" else T)
    assert s.group_size == Gr
    lo, hi, n = _loop_stats(x, axis, Gr, ignore)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in s.lo.shape)).view(-1, 2).tolist():
        key = tuple(idx)
        assert float(s.lo[key]) == lo.get(key, 0.0) and float(s.hi[key]) == hi.get(key, 0.0)
        assert int(s.count[key]) == n.get(key, 0)


def test_whole_axis_groups_shapes():
    x = torch.randn(2, 5, 7)
    assert minmax_stats(x, "token").lo.shape == (2, 5, 1)
    assert minmax_stats(x, "channel").lo.shape == (2, 1, 7)


def test_masked_outlier_does_not_widen_the_range():
    x = torch.randn(4, 16)
    x[1, 3] = 1000.0
    ignore = torch.zeros_like(x, dtype=torch.bool)
    ignore[1, 3] = True
    s = minmax_stats(x, "token", None, ignore)
    assert float(s.hi[1, 0]) < 10
    q = quantize_minmax(x, 4, "token", None, ignore)
    y = UniformQuantizer(4, "token", 16).dequantize(q)
    scale = q.scales.float()
    err = (y - x).abs()
    err[1, 3] = 0
    assert bool((err <= scale / 2 + 1e-6).all())


def test_quantize_minmax_equals_uniform_quantizer_without_mask():
    x = torch.randn(3, 10, 12, dtype=torch.float16)
    for axis in ("token", "channel"):
        a, b = quantize_minmax(x, 2, axis, 4), UniformQuantizer(2, axis, 4).quantize(x)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales) and torch.equal(a.zeros, b.zeros)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_normal_codebook_is_gaussian_quantiles(bits):
    cb = normal_codebook(bits)
    n = 1 << bits
    assert cb.shape == (n,) and bool((cb[1:] > cb[:-1]).all())
    torch.testing.assert_close(cb, -cb.flip(0))  # symmetric
    normal = torch.distributions.Normal(0.0, 1.0)
    torch.testing.assert_close(normal.cdf(cb), (torch.arange(n) + 0.5) / n, rtol=0, atol=1e-6)


def test_codebook_quantizer_picks_the_nearest_level():
    q = CodebookQuantizer(3, "token", 8)
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    qt = q.quantize(x)
    y = q.dequantize(qt)
    scale = qt.scales.float().repeat_interleave(8, -1)
    levels = q.codebook[None, None, :] * scale[..., None]  # every level of every element's group
    best = (levels - x[..., None]).abs().min(-1).values
    torch.testing.assert_close((y - x).abs(), best, rtol=0, atol=1e-6)
    assert qt.zeros is None and torch.equal(qt.codebook, normal_codebook(3))


def test_codebook_rejects_bad_codebook():
    with pytest.raises(ValueError, match="codebook"):
        CodebookQuantizer(2, "token", 4, codebook=torch.tensor([0.0, 1.0, 0.5, 2.0]))
    with pytest.raises(ValueError, match="bits"):
        normal_codebook(9)


def _quantized(kind):
    x = torch.randn(2, 3, 9, 10, dtype=torch.bfloat16)
    if kind == "uniform":
        return UniformQuantizer(3, "channel", 4).quantize(x)
    if kind == "uniform8":
        return UniformQuantizer(8, "token", 4).quantize(x)  # fp32 scales for bf16 at 8 bits
    return CodebookQuantizer(4, "token", 5).quantize(x.float())


@pytest.mark.parametrize("kind", ["uniform", "uniform8", "codebook"])
def test_serialization_round_trip_is_bit_exact(kind):
    q = _quantized(kind)
    r = from_bytes(to_bytes(q))
    for name in ("codes", "scales", "zeros", "codebook"):
        a, b = getattr(q, name), getattr(r, name)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(
                a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                b.view(torch.uint8) if b.dtype != torch.uint8 else b,
            )
    assert (r.bits, r.axis, r.group_size, r.shape, r.dtype) == (q.bits, q.axis, q.group_size, q.shape, q.dtype)


def test_corrupted_payload_raises():
    blob = bytearray(to_bytes(_quantized("uniform")))
    blob[len(blob) // 2] ^= 0x40
    with pytest.raises(ValueError, match="checksum"):
        from_bytes(bytes(blob))
    with pytest.raises(ValueError, match="too short|truncated|checksum"):
        from_bytes(bytes(blob[:10]))


def test_unknown_version_and_magic_raise():
    blob = bytearray(to_bytes(_quantized("uniform")))
    struct.pack_into("<H", blob, 4, FORMAT_VERSION + 1)
    with pytest.raises(ValueError, match="version"):
        from_bytes(bytes(blob))
    blob[:4] = b"NOPE"
    with pytest.raises(ValueError, match="magic"):
        from_bytes(bytes(blob))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        to_bytes("not a tensor")
