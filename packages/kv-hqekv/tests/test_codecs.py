"""HqeKV's page codecs (``hqekv-2`` ... ``hqekv-3.25``): found by name, each tier equal to the method's quantizer,
bytes near the budget, settings checked."""

import pytest
import torch

import kvpages
from kv_hqekv import PRESETS, Shares, tier_quantizer
from kv_hqekv.codecs import TIER_WIDTHS, HqeKVPageCodec, sink_score

NAMES = ["hqekv-2", "hqekv-2.8", "hqekv-3.2", "hqekv-3.25"]


def page(T=64, H=3, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g).to(dtype), torch.randn(T, H, D, generator=g).to(dtype)


@pytest.mark.parametrize("name", NAMES)
def test_registered_with_the_table9_shares(name):
    c = kvpages.codec(name)
    assert isinstance(c, HqeKVPageCodec) and c.name == name and not c.lossless
    s = PRESETS[f"llama-{name.split('-')[1]}"]
    assert c.config()["shares"] == list(s.as_tuple())
    assert c.avg_bits == pytest.approx(s.avg_bits + s.evict)  # evicted tokens are kept at 1 bit


@pytest.mark.parametrize("name", ["hqekv-2", "hqekv-3.2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T", [16, 64, 100])
def test_each_tier_decodes_as_the_methods_quantizer(name, dtype, T):
    """Every token of a tier equals tier_quantizer's round trip of that tier's tokens (position order)."""
    k, v = page(T, 3, 64, dtype, seed=T)
    c = kvpages.codec(name)
    k2, v2 = c.decode(c.encode(k, v))
    assert k2.shape == k.shape and k2.dtype == dtype and v2.dtype == dtype
    kt, vt = c.tiers(k, v)
    for kind, x, y, t in (("key", k, k2, kt), ("value", v, v2, vt)):
        found = tuple(int((t == i).sum()) for i in range(4))
        assert found == c.counts(T)
        for i, bits in enumerate(TIER_WIDTHS):
            sel = (t == i).nonzero().flatten()
            if not sel.numel():
                continue
            xs = x[sel].transpose(0, 1)
            if bits == 16:
                want = xs
            else:
                q = tier_quantizer(bits, kind, 32)
                want = q.dequantize(q.quantize(xs))
            assert torch.equal(y[sel].transpose(0, 1), want), (kind, bits)


def test_tiers_follow_the_query_free_importance():
    """Keys ranked by the sink score, values by sink score x token range (§3.2's joint metric, queries replaced)."""
    T = 64
    k, v = page(T)
    c = kvpages.codec("hqekv-3.2", fp16_tokens=2)
    kt, vt = c.tiers(k, v)
    s = sink_score(k, v)
    rng = (v.amax(-1) - v.amin(-1)).sum(-1)
    n16 = c.counts(T)[0]
    assert n16 == 2
    assert kt[s.topk(n16).indices].eq(0).all() and vt[(s * rng).topk(n16).indices].eq(0).all()
    order = s.argsort(descending=True, stable=True)
    assert kt[order].tolist() == sorted(kt.tolist())  # monotone: a more important key is never coarser
    k2, _ = c.decode(c.encode(k, v))
    assert torch.equal(k2[kt == 0], k[kt == 0])


def test_error_bounds_of_the_tiers():
    """Uniform tiers within scale/2 of their group; the 1-bit tier at mean +- 0.674 std (normalized)."""
    k, v = page(64, 2, 64)
    c = kvpages.codec("hqekv-2")
    k2, v2 = c.decode(c.encode(k, v))
    _, vt = c.tiers(k, v)
    for i, bits in ((1, 4), (2, 2)):
        sel = vt == i
        xs = v[sel]  # [n, H, D]: values per token in groups of 32 channels
        g = xs.reshape(*xs.shape[:2], 2, 32)
        step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / (2**bits - 1)).expand_as(g).reshape(xs.shape)
        assert bool(((v2[sel] - xs).abs() <= step / 2 * (1 + 1e-5) + 1e-6).all())
    assert torch.isfinite(k2).all() and (k2 - k).norm() / k.norm() < 0.5


@pytest.mark.parametrize(("name", "low", "high"), [("hqekv-2", 4.0, 8.0), ("hqekv-3.2", 3.0, 5.0)])
def test_bytes_per_token_below_fp16(name, low, high):
    """Llama-3-8B's layer shape, a 64-token page: about 16 / avg_bits of fp16, less the statistics."""
    k, v = page(64, 8, 128, torch.float16)
    c = kvpages.codec(name)
    ratio = c.fp16_bytes(64, 8, 128) / len(c.encode(k, v))
    assert low < ratio < min(high, 16 / c.avg_bits)


def test_other_settings_refuse_the_page():
    k, v = page(32, 2, 64)
    blob = kvpages.codec("hqekv-2").encode(k, v)
    for other in (
        kvpages.codec("hqekv-3.2"),
        kvpages.codec("hqekv-2", group_size=16),
        kvpages.codec("hqekv-2", one_bit="uniform"),
        kvpages.codec("hqekv-2", fp16_tokens=1),
    ):
        with pytest.raises(kvpages.CorruptEntry, match="written by codec"):
            other.decode(blob)


def test_uniform_one_bit_and_custom_shares_round_trip():
    """Table 6's uniform 1-bit tier and other shares / groups: each tier still equals the method's quantizer."""
    k, v = page(40, 2, 48, torch.float16)
    for c, one_bit, G in (
        (kvpages.codec("hqekv-2", one_bit="uniform", shares=Shares(0.0, 0.5, 0.5, 0.0)), "uniform", 32),
        (kvpages.codec("hqekv-2", group_size=8, fp16_tokens=3), "normalized", 8),
    ):
        k2, v2 = c.decode(c.encode(k, v))
        kt, vt = c.tiers(k, v)
        for kind, x, y, t in (("key", k, k2, kt), ("value", v, v2, vt)):
            for i, bits in enumerate(TIER_WIDTHS[1:], start=1):
                sel = (t == i).nonzero().flatten()
                if sel.numel():
                    q = tier_quantizer(bits, kind, G, one_bit)
                    xs = x[sel].transpose(0, 1)
                    assert torch.equal(y[sel].transpose(0, 1), q.dequantize(q.quantize(xs))), (kind, bits)
        assert torch.equal(k2[kt == 0], k[kt == 0]) and int((kt == 0).sum()) == c.counts(40)[0]


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="shares must be a Table 9 preset"):
        HqeKVPageCodec(shares="llama-9")
    with pytest.raises(TypeError, match="shares must be a preset name"):
        HqeKVPageCodec(shares=(0.5, 0.5, 0, 0))
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        kvpages.codec("hqekv-2", group_size=0)
    with pytest.raises(TypeError, match="fp16_tokens must be an int"):
        HqeKVPageCodec(fp16_tokens=1.5)
    with pytest.raises(ValueError, match="fp16_tokens must be an int >= 0"):
        kvpages.codec("hqekv-2", fp16_tokens=-1)
    with pytest.raises(ValueError, match="one_bit must be one of"):
        kvpages.codec("hqekv-3.2", one_bit="ternary")
    with pytest.raises(ValueError, match="invalid options"):
        kvpages.codec("hqekv-2", window=20)  # a page codec has no query window


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("T", "H", "D", "dtype"), [(32, 2, 64, torch.float32), (64, 8, 128, torch.float16),
                                                    (100, 3, 64, torch.bfloat16)])  # fmt: skip
def test_encoded_size_is_fixed_by_the_shape(name, T, H, D, dtype):
    """The tier counts depend only on T, so every page of a shape has ``max_encoded_bytes`` bytes."""
    c = kvpages.codec(name)
    assert c.bounded_size and c.accepts_importance
    for seed in range(2):
        k, v = page(T, H, D, dtype, seed)
        assert len(c.encode(k, v)) == c.max_encoded_bytes(T, H, D, dtype)
        imp = torch.rand(T, H, generator=torch.Generator().manual_seed(seed))
        assert len(c.encode(k, v, importance=imp)) == c.max_encoded_bytes(T, H, D, dtype)


def test_importance_ranks_the_key_tiers():
    """An engine's importance ``[T, H]`` (summed over heads) replaces sink_score as the key metric (§3.2)."""
    c = kvpages.codec("hqekv-2", fp16_tokens=2)
    T, H = 64, 3
    k, v = page(T, H)
    imp = torch.zeros(T, H)
    imp[9, 1], imp[40, 0] = 3.0, 2.0
    kt, _ = c.tiers(k, v, imp)
    assert (kt == 0).nonzero().flatten().tolist() == [9, 40]  # tier 0: fp16
    k2, _ = c.decode(c.encode(k, v, importance=imp))
    assert torch.equal(k2[[9, 40]], k[[9, 40]])
