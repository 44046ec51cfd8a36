"""Page codecs: lossless round trips are bit-exact, lossy ones stay within scale/2 per group, bad input is refused."""

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import kvpages
from kvcodec import UniformQuantizer
from kvpages import CorruptEntry, UniformPageCodec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def page(seed, T, H, D, dtype, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(T, H, D, generator=g) * scale).to(dtype)
    v = (torch.randn(T, H, D, generator=g) * scale).to(dtype)
    return k, v


shapes = st.tuples(st.integers(1, 40), st.integers(1, 4), st.integers(1, 70))


@settings(max_examples=25, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16), strided=st.booleans())
def test_lossless_round_trip_is_bit_exact(shape, dtype, seed, strided):
    """Invariant: decode(encode(k, v)) == (k, v) bit for bit, for any shape, dtype and memory layout."""
    k, v = page(seed, *shape, dtype)
    if strided:  # a non-contiguous view of the same values
        k = k.transpose(0, 1).contiguous().transpose(0, 1)
        v = v[:, :, :].flip(0).flip(0)
    codec = kvpages.codec("lossless")
    k2, v2 = codec.decode(codec.encode(k, v))
    assert k2.dtype == dtype and k2.shape == k.shape and v2.shape == v.shape
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_lossless_keeps_nan_and_inf_payloads():
    k = torch.tensor([[[float("nan"), float("inf"), -0.0]]], dtype=torch.float16)
    codec = kvpages.codec("lossless")
    k2, v2 = codec.decode(codec.encode(k, k.clone()))
    assert k2.view(torch.int16).equal(k.view(torch.int16)) and v2.view(torch.int16).equal(k.view(torch.int16))


def group_bound(x, codec, axis, group):
    """scale/2 per element, from the same quantizer the codec uses ([H, T, D] per KV head)."""
    T, _H, D = x.shape
    q = codec._quantizer(axis, group, T, D).quantize(x.transpose(0, 1))
    G = q.group_size
    s = q.scales.float()
    s = s.repeat_interleave(G, dim=-1)[..., :D] if axis == "token" else s.repeat_interleave(G, dim=-2)[..., :T, :]
    return (s / 2).transpose(0, 1)


@settings(max_examples=25, deadline=None)
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    name=st.sampled_from(["kivi-4", "kivi-2", "int8"]),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
)
def test_lossy_round_trip_within_half_a_step(shape, dtype, name, seed, scale):
    """Invariant: |x - decode(encode(x))| <= scale/2 of the element's group, plus one rounding of the page dtype."""
    k, v = page(seed, *shape, dtype, scale)
    codec = kvpages.codec(name)
    k2, v2 = codec.decode(codec.encode(k, v))
    assert k2.dtype == dtype and k2.shape == k.shape and v2.shape == v.shape
    eps = torch.finfo(dtype).eps
    for x, y, axis, group in (
        (k, k2, codec.key_axis, codec.key_group_size),
        (v, v2, codec.value_axis, codec.value_group_size),
    ):
        bound = group_bound(x, codec, axis, group) + x.float().abs() * eps + y.float().abs() * eps
        assert bool(((x.float() - y.float()).abs() <= bound * (1 + 1e-6) + 1e-30).all())


def test_kivi_grouping_follows_the_paper():
    """kivi-4: keys per channel over the whole page, values per token in groups of 32 (KIVI §3.2)."""
    c = kvpages.codec("kivi-4")
    assert (c.bits, c.key_axis, c.key_group_size, c.value_axis, c.value_group_size) == (4, "channel", None, "token", 32)
    k, v = page(0, 16, 2, 64, torch.float16)
    k2, v2 = c.decode(c.encode(k, v))
    # the same codes as quantizing each head's keys [T, D] with per-channel groups of T tokens
    ref = UniformQuantizer(4, "channel", 16)
    expect = ref.dequantize(ref.quantize(k.transpose(0, 1))).transpose(0, 1)
    assert torch.equal(k2, expect)
    refv = UniformQuantizer(4, "token", 32)
    assert torch.equal(v2, refv.dequantize(refv.quantize(v.transpose(0, 1))).transpose(0, 1))


def test_lossy_sizes_shrink_with_bits():
    k, v = page(1, 64, 8, 128, torch.float16)
    sizes = {n: len(kvpages.codec(n).encode(k, v)) for n in ("lossless", "int8", "kivi-4", "kivi-2")}
    fp16 = 2 * k.numel() * 2
    assert fp16 < sizes["lossless"] < fp16 + 100
    assert sizes["lossless"] > sizes["int8"] > sizes["kivi-4"] > sizes["kivi-2"]
    assert sizes["kivi-2"] < fp16 / 5


def test_config_hash_depends_on_settings_and_blob_checks_it():
    a, b = kvpages.codec("kivi-4"), kvpages.codec("kivi-4", value_group_size=64)
    assert a.config_hash() == kvpages.codec("kivi-4").config_hash()
    assert len({a.config_hash(), b.config_hash(), kvpages.codec("kivi-2").config_hash()}) == 3
    k, v = page(2, 8, 2, 64, torch.float32)
    with pytest.raises(CorruptEntry, match="written by codec"):
        b.decode(a.encode(k, v))


@pytest.mark.parametrize("name", ["lossless", "kivi-4", "kivi-2", "int8"])
def test_corrupt_or_truncated_blob_raises_corrupt_entry(name):
    codec = kvpages.codec(name)
    blob = codec.encode(*page(3, 8, 2, 32, torch.float16))
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x10
    for bad in (bytes(flipped), blob[:-1], blob[: len(blob) // 2], b"", blob + b"\0"):
        with pytest.raises(CorruptEntry):
            codec.decode(bad)
    assert issubclass(CorruptEntry, ValueError)


def test_decode_to_device_argument():
    codec = kvpages.codec("kivi-2")
    k2, _ = codec.decode(codec.encode(*page(4, 4, 1, 32, torch.float32)), device="cpu")
    assert k2.device.type == "cpu"


def test_bad_inputs_are_refused_with_the_argument_named():
    codec = kvpages.codec("kivi-4")
    k, v = page(5, 4, 2, 32, torch.float16)
    with pytest.raises(TypeError, match="keys"):
        codec.encode(k.numpy(), v)
    with pytest.raises(ValueError, match="keys must have rank 3"):
        codec.encode(k[0], v)
    with pytest.raises(ValueError, match="same shape"):
        codec.encode(k, v[:2])
    with pytest.raises(TypeError, match="same dtype"):
        codec.encode(k, v.float())
    with pytest.raises(TypeError, match="keys must be float32"):
        codec.encode(k.double(), v.double())
    with pytest.raises(ValueError, match="non-empty"):
        codec.encode(k[:0], v[:0])
    bad = k.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="keys must be finite"):
        codec.encode(bad, v)


def test_registry_names_and_errors():
    assert {"lossless", "kivi-4", "kivi-2", "int8"} <= set(kvpages.codec_names())
    with pytest.raises(ValueError, match="unknown codec 'kivi-3'; available: .*kivi-4"):
        kvpages.codec("kivi-3")
    with pytest.raises(ValueError, match="invalid options"):
        kvpages.codec("lossless", bits=4)
    with pytest.raises(ValueError, match="bits must be one of"):
        UniformPageCodec(bits=5)
    with pytest.raises(ValueError, match="value_group_size"):
        kvpages.codec("kivi-2", value_group_size=0)
    with pytest.raises(ValueError, match="key_axis"):
        kvpages.codec("kivi-2", key_axis="row")


class _EP:
    def __init__(self, name, obj):
        self.name, self._obj = name, obj

    def load(self):
        return self._obj


def test_third_party_codecs_from_entry_points(monkeypatch):
    """A package's entry point (a mapping name -> factory) adds codecs; a non-mapping entry point is refused."""
    import kvpages.registry as reg

    class Halves(kvpages.LosslessCodec):
        name = "halves"

    monkeypatch.setattr(reg, "entry_points", lambda group: [_EP("pkg", {"halves": Halves})])
    assert "halves" in kvpages.codec_names()
    built = kvpages.codec("halves")
    assert isinstance(built, Halves) and built.config_hash() != kvpages.codec("lossless").config_hash()
    monkeypatch.setattr(reg, "entry_points", lambda group: [_EP("pkg", ["halves"])])
    with pytest.raises(TypeError, match="must load a mapping"):
        kvpages.codec_names()
    monkeypatch.setattr(reg, "entry_points", lambda group: [_EP("pkg", {"kivi-4": Halves})])
    with pytest.raises(ValueError, match="already registered"):
        kvpages.codec("kivi-4")


class _BrokenEP:
    name, value = "gone", "missing_package.codecs:CODECS"

    def load(self):
        raise ModuleNotFoundError("No module named 'missing_package'")


def test_an_entry_point_whose_package_cannot_be_imported_is_skipped_with_a_warning(monkeypatch):
    """Invariant: metadata left without its code (a package removed, a path that lacks it) costs only that package's
    codecs, with a warning naming the entry point; the built-ins and every other package's codecs still work."""
    import kvpages.registry as reg

    class Halves(kvpages.LosslessCodec):
        name = "halves"

    monkeypatch.setattr(reg, "entry_points", lambda group: [_BrokenEP(), _EP("pkg", {"halves": Halves})])
    with pytest.warns(RuntimeWarning, match="'gone'.*missing_package"):
        names = kvpages.codec_names()
    assert "halves" in names and "kivi-4" in names and "lossless" in names
    with pytest.warns(RuntimeWarning, match="skipped"):
        assert isinstance(kvpages.codec("kivi-4"), UniformPageCodec)


@pytest.mark.parametrize("name", ["lossless", "kivi-4", "kivi-2", "int8"])
@pytest.mark.parametrize(("T", "H", "D"), [(32, 2, 64), (7, 3, 33), (64, 8, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_builtin_codecs_declare_their_fixed_encoded_size(name, T, H, D, dtype):
    """``max_encoded_bytes`` is the exact size of every blob of that shape (framing included)."""
    codec = kvpages.codec(name)
    assert codec.bounded_size and not codec.accepts_importance
    k, v = page(T, T, H, D, dtype)
    assert len(codec.encode(k, v)) == codec.max_encoded_bytes(T, H, D, dtype)


def test_importance_is_refused_by_a_codec_that_does_not_declare_it():
    k, v = page(0, 8, 2, 16, torch.float32)
    with pytest.raises(TypeError, match="does not accept an importance"):
        kvpages.codec("kivi-4").encode(k, v, importance=torch.ones(8, 2))


def test_max_encoded_bytes_checks_its_arguments():
    codec = kvpages.codec("kivi-4")
    with pytest.raises(ValueError, match="tokens must be an int >= 1"):
        codec.max_encoded_bytes(0, 2, 64, torch.float16)
    with pytest.raises(ValueError, match="dtype must be"):
        codec.max_encoded_bytes(32, 2, 64, torch.float64)


def test_frame_length_reads_a_frame_followed_by_padding():
    k, v = page(1, 8, 2, 16, torch.float16)
    codec = kvpages.codec("kivi-2")
    blob = codec.encode(k, v)
    slot = blob + bytes(100)
    assert kvpages.frame_length(slot) == len(blob)
    k2, _ = codec.decode(slot[: kvpages.frame_length(slot)])
    assert k2.shape == k.shape
    with pytest.raises(CorruptEntry, match="not a kvpages frame"):
        kvpages.frame_length(bytes(100))
