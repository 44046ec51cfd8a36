"""HEX's page codecs (``hex-3/4``, ``kcvt-3/4``): found by name, decode to what HEXStore reads, bounded, smaller."""

import pytest
import torch

import kvpages
from kv_hex import HEXConfig, HEXStore
from kv_hex.codecs import HEXPageCodec, sink_score
from kvcore import FULL, Plan

NAMES = ["hex-3", "hex-4", "kcvt-3", "kcvt-4"]


def page(T=64, H=3, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=g)
    k[..., 5] *= 8  # an outlier channel, as real keys have
    v = torch.randn(T, H, D, generator=g)
    return k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("name", NAMES)
def test_registered_and_configured_as_the_paper(name):
    c = kvpages.codec(name)
    assert isinstance(c, HEXPageCodec) and c.name == name and not c.lossless
    assert c.bits == int(name[-1])
    if name.startswith("hex"):
        assert (c.rho, c.heavy_ratio, c.mask_kind) == (0.03125, 0.02, "expander")  # §4.2
    else:
        assert (c.heavy_ratio, c.mask_kind) == (0.0, "none")  # Table 4 "Quant only"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decodes_to_what_the_hex_store_reads(name, dtype):
    """The codec's page equals HEXStore.read() after writing the same tokens with the codec's tiers."""
    T, H, D = 100, 3, 64
    k, v = page(T, H, D, dtype)
    c = kvpages.codec(name)
    k2, v2 = c.decode(c.encode(k, v))
    assert k2.shape == k.shape and v2.shape == v.shape and k2.dtype == dtype and v2.dtype == dtype
    store = HEXStore(c.hex_config(T))
    store.write(k.transpose(0, 1)[None], v.transpose(0, 1)[None], Plan(c.tiers(k, v)), torch.arange(T)[None])
    view = store.read()
    assert torch.equal(k2, view.keys[0].transpose(0, 1)) and torch.equal(v2, view.values[0].transpose(0, 1))


def test_heavy_tokens_are_exact_and_chosen_by_the_sink_score():
    T, H, D = 100, 3, 64
    k, v = page(T, H, D)
    v[17] *= 0.01  # a value drain with an outlying key: the highest sink score
    k[17] += 5
    c = kvpages.codec("hex-3")
    heavy = (c.tiers(k, v)[0] == FULL).all(0)
    assert int(heavy.sum()) == int(0.02 * T) == 2 and bool(heavy[17])
    assert heavy.nonzero().flatten().tolist() == sink_score(k, v).topk(2).indices.sort().values.tolist()
    k2, v2 = c.decode(c.encode(k, v))
    assert torch.equal(k2[heavy], k[heavy]) and torch.equal(v2[heavy], v[heavy])


@pytest.mark.parametrize("bits", [3, 4])
def test_error_within_half_a_kcvt_step(bits):
    """Keys per channel over a head's page, values per token over the page's heads: |error| <= (max-min)/(2^b-1)/2."""
    k, v = page(64, 3, 64)
    k2, v2 = kvpages.codec(f"kcvt-{bits}").decode(kvpages.codec(f"kcvt-{bits}").encode(k, v))
    step_k = (k.amax(0, keepdim=True) - k.amin(0, keepdim=True)) / (2**bits - 1)
    step_v = (v.amax((1, 2), keepdim=True) - v.amin((1, 2), keepdim=True)) / (2**bits - 1)
    assert bool(((k2 - k).abs() <= step_k / 2 * (1 + 1e-5) + 1e-6).all())
    assert bool(((v2 - v).abs() <= step_v / 2 * (1 + 1e-5) + 1e-6).all())
    h2 = kvpages.codec(f"hex-{bits}")
    kh, vh = h2.decode(h2.encode(k, v))
    assert (kh - k).norm() < (k2 - k).norm() and (vh - v).norm() < (v2 - v).norm()  # overlay + heavy: closer


@pytest.mark.parametrize(("name", "low"), [("kcvt-3", 4.5), ("kcvt-4", 3.5), ("hex-3", 3.7), ("hex-4", 3.0)])
def test_bytes_per_token_below_fp16(name, low):
    """Llama-3-8B's layer shape, a 64-token page: codes are bits/16 of fp16, statistics and overlay cost the rest."""
    k, v = page(64, 8, 128, torch.float16)
    c = kvpages.codec(name)
    ratio = c.fp16_bytes(64, 8, 128) / len(c.encode(k, v))
    assert low < ratio < 16 / c.bits


def test_other_settings_refuse_the_page():
    k, v = page(32, 2, 64)
    blob = kvpages.codec("hex-3").encode(k, v)
    for other in (kvpages.codec("hex-4"), kvpages.codec("kcvt-3"), kvpages.codec("hex-3", rho=0.046875)):
        with pytest.raises(kvpages.CorruptEntry, match="written by codec"):
            other.decode(blob)
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 1
    with pytest.raises(kvpages.CorruptEntry):
        kvpages.codec("hex-3").decode(bytes(bad))


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="bits must be one of"):
        HEXPageCodec(bits=5)
    with pytest.raises(TypeError, match="bits must be an int"):
        HEXPageCodec(bits=3.0)
    with pytest.raises(ValueError, match="rho"):
        kvpages.codec("hex-3", rho=1.5)
    with pytest.raises(ValueError, match="heavy_ratio"):
        kvpages.codec("hex-4", heavy_ratio=1.0)
    with pytest.raises(ValueError, match="value_scope"):
        kvpages.codec("kcvt-3", value_scope="row")
    with pytest.raises(TypeError, match="masked_stats"):
        HEXPageCodec(masked_stats=1)
    with pytest.raises(ValueError, match="invalid options"):
        kvpages.codec("hex-3", recent=8)  # a page has no recent window


def test_value_scope_head_and_small_pages():
    """Groups per head (an SGLang page holds every layer's heads) and pages shorter than a heavy token or a byte."""
    c = kvpages.codec("hex-3", value_scope="head")
    assert c.config_hash() != kvpages.codec("hex-3").config_hash()
    for T in (1, 5, 49, 50):
        k, v = page(T, 4, 32, torch.float16, seed=T)
        k2, v2 = c.decode(c.encode(k, v))
        assert k2.shape == k.shape
        store = HEXStore(c.hex_config(T))
        store.write(k.transpose(0, 1)[None], v.transpose(0, 1)[None], Plan(c.tiers(k, v)), torch.arange(T)[None])
        assert torch.equal(v2, store.read().values[0].transpose(0, 1))
        assert int((c.tiers(k, v) == FULL).all(1).sum()) == int(0.02 * T)


def test_hex_config_matches_the_codec():
    c = kvpages.codec("hex-4", seed=7)
    assert c.hex_config(96) == HEXConfig(bits=4, recent=0, block_size=96, seed=7)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("T", "H", "D", "dtype"), [(32, 2, 64, torch.float32), (64, 8, 128, torch.float16),
                                                    (100, 3, 64, torch.bfloat16)])  # fmt: skip
def test_max_encoded_bytes_bounds_every_page(name, T, H, D, dtype):
    """Declared bound: no page of that shape (any heavy tokens) encodes to more; the expander's per-token mask
    counts are equal, so every page has exactly that size."""
    c = kvpages.codec(name)
    assert c.bounded_size and c.accepts_importance
    bound = c.max_encoded_bytes(T, H, D, dtype)
    sizes = set()
    for seed in range(3):
        k, v = page(T, H, D, dtype, seed)
        sizes.add(len(c.encode(k, v)))
        sizes.add(len(c.encode(k, v, importance=torch.rand(T, H, generator=torch.Generator().manual_seed(seed)))))
    assert max(sizes) <= bound and bound in sizes


def test_importance_picks_the_heavy_tokens():
    """An engine's importance ``[T, H]`` (summed over heads) replaces sink_score as HEX's heavy-hitter ranking."""
    c = kvpages.codec("hex-3")
    T, H = 100, 3  # int(0.02 * 100) = 2 heavy tokens
    k, v = page(T, H)
    imp = torch.zeros(T, H)
    imp[17, 0], imp[71, 2] = 5.0, 4.0
    heavy = (c.tiers(k, v, imp)[0, 0] == FULL).nonzero().flatten().tolist()
    assert heavy == [17, 71]
    k2, v2 = c.decode(c.encode(k, v, importance=imp))
    assert torch.equal(k2[[17, 71]], k[[17, 71]]) and torch.equal(v2[[17, 71]], v[[17, 71]])
    with pytest.raises(ValueError, match="importance must be"):
        c.encode(k, v, importance=torch.ones(T, H + 1))
