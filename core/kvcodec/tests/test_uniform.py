"""UniformQuantizer: error bound, no clamping, idempotence, exact nbytes, layouts, bad inputs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_testutil import DTYPES, group_view, make_data, ulp

from kvcodec import QUANT_BITS, UniformQuantizer, unpack_codes
from kvcore import QuantizedTensor, Quantizer

AXES = ("token", "channel")

cases = st.fixed_dictionaries(
    {
        "bits": st.sampled_from(QUANT_BITS),
        "axis": st.sampled_from(AXES),
        "G": st.sampled_from([1, 2, 3, 4, 5, 8, 16, 32, 64]),
        "lead": st.sampled_from([(), (2,), (1, 2)]),
        "T": st.integers(1, 13),
        "D": st.integers(1, 21),
        "dtype": st.sampled_from(DTYPES),
        "kind": st.integers(0, 5),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def _quantize(c):
    x = make_data(c["seed"], (*c["lead"], c["T"], c["D"]), c["kind"], c["dtype"])
    quant = UniformQuantizer(c["bits"], c["axis"], c["G"])
    return x, quant, quant.quantize(x)


def _per_element(stat: torch.Tensor, axis: str, G: int, T: int, D: int) -> torch.Tensor:
    if axis == "token":
        return stat.repeat_interleave(G, -1)[..., :D]
    return stat.repeat_interleave(G, -2)[..., :T, :]


@settings(max_examples=60, deadline=None)
@given(cases)
def test_error_within_half_scale(c):
    x, quant, q = _quantize(c)
    y = quant.dequantize(q)
    assert y.dtype == x.dtype and y.shape == x.shape
    T, D = x.shape[-2:]
    s = _per_element(q.scales.double(), c["axis"], c["G"], T, D)
    z = _per_element(q.zeros.double(), c["axis"], c["G"], T, D)
    codes = unpack_codes(q.codes, c["bits"], D).double()
    # float32 arithmetic slack (a subtraction, a division, a product, a sum) + the output dtype's rounding
    slack = 4 * 2.0**-24 * (x.double().abs() + z.abs() + codes * s) + ulp(y, x.dtype) / 2
    err = (x.double() - y.double()).abs()
    assert bool((err <= s / 2 + slack).all()), float((err - s / 2 - slack).max())


@settings(max_examples=60, deadline=None)
@given(cases)
def test_zero_is_group_min_and_no_code_clamps(c):
    x, _quant, q = _quantize(c)
    levels = 2 ** c["bits"] - 1
    M = math.prod(c["lead"])
    xs = x.reshape(M, *x.shape[-2:])
    zeros = q.zeros.reshape(M, *q.zeros.shape[-2:])
    scales = q.scales.reshape(M, *q.scales.shape[-2:])
    assert q.zeros.dtype == x.dtype
    for idx, elems in group_view(xs, c["axis"], c["G"]):
        mn, mx = elems.double().min(), elems.double().max()
        zero, scale = zeros[idx].double(), scales[idx].double()
        assert zero == mn  # the zero point is the exact group minimum
        assert scale > 0
        # no element rounds past the top code: (max - zero) / scale < levels + 1/2
        assert (mx - zero) / scale < levels + 0.5
        # the scale is (max - min) / levels rounded to its storage dtype (up to the one-ulp bump), or the floor
        ideal = (mx - mn) / levels
        assert abs(scale - ideal) <= 1.01 * ulp(scale, q.scales.dtype) or scale <= 2.0 ** (c["bits"] - 24)


@settings(max_examples=60, deadline=None)
@given(cases)
def test_idempotent(c):
    _x, quant, q = _quantize(c)
    q2 = quant.quantize(quant.dequantize(q))
    assert torch.equal(q2.codes, q.codes)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", QUANT_BITS)
def test_idempotent_on_many_groups(bits, dtype):
    # thousands of groups per case: rare rounding cases (e.g. a 16-bit scale that cannot resolve
    # 1/255 steps) show up here even when the property test's few examples miss them
    for kind in range(6):
        for axis in AXES:
            x = make_data(100 + kind, (2, 64, 64), kind, dtype)
            quant = UniformQuantizer(bits, axis, 32)
            q = quant.quantize(x)
            assert torch.equal(quant.quantize(quant.dequantize(q)).codes, q.codes), (kind, axis)


@settings(max_examples=40, deadline=None)
@given(cases)
def test_layout_and_exact_nbytes(c):
    x, _quant, q = _quantize(c)
    bits, G, (T, D) = c["bits"], c["G"], x.shape[-2:]
    lead = c["lead"]
    assert isinstance(q, QuantizedTensor)
    assert (q.bits, q.axis, q.group_size, q.shape, q.dtype) == (bits, c["axis"], G, tuple(x.shape), x.dtype)
    width = -(-(D * bits) // 8)
    groups = (*lead, T, -(-D // G)) if c["axis"] == "token" else (*lead, -(-T // G), D)
    assert q.codes.shape == (*lead, T, width) and q.codes.dtype == torch.uint8
    assert q.scales.shape == groups and q.zeros.shape == groups
    scale_bytes = 4 if x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and bits == 8) else 2
    zero_bytes = 4 if x.dtype == torch.float32 else 2
    n_groups = math.prod(groups)
    assert q.nbytes == math.prod(lead) * T * width + n_groups * (scale_bytes + zero_bytes)
    # the count is real memory: no tensor is a view of a larger buffer
    for t in (q.codes, q.scales, q.zeros):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_constant_groups_are_exact_and_scale_positive():
    for dtype in DTYPES:
        for axis in AXES:
            x = torch.full((3, 8, 6), 1.5).to(dtype)
            q = UniformQuantizer(2, axis, 4).quantize(x)
            assert bool((q.scales.float() > 0).all())
            assert torch.equal(UniformQuantizer(2, axis, 4).dequantize(q), x)


def test_known_values_token_and_channel():
    # one token group [0, 1, 2, 3] at 2 bits: scale 1, zero 0, codes = values
    x = torch.tensor([[[0.0, 1.0, 2.0, 3.0]]])
    q = UniformQuantizer(2, "token", 4).quantize(x)
    assert q.scales.item() == 1.0 and q.zeros.item() == 0.0
    assert unpack_codes(q.codes, 2, 4).tolist() == [[[0, 1, 2, 3]]]
    # the same values down a channel: one group of 4 tokens per channel
    q = UniformQuantizer(2, "channel", 4).quantize(x.transpose(-1, -2))
    assert q.scales.shape == (1, 1, 1) and q.scales.item() == 1.0
    assert unpack_codes(q.codes, 2, 1).flatten().tolist() == [0, 1, 2, 3]


def test_partial_groups_are_independent():
    # the partial last group's range must not leak into the full groups
    x = torch.tensor([[[0.0, 1.0, 2.0, 3.0, 100.0]]])
    q = UniformQuantizer(2, "token", 4).quantize(x)
    assert q.scales.shape == (1, 1, 2)
    assert q.scales[0, 0, 0].item() == 1.0
    y = UniformQuantizer(2, "token", 4).dequantize(q)
    assert torch.equal(y, x)


def test_is_a_kvcore_quantizer():
    assert isinstance(UniformQuantizer(4, "channel", 32), Quantizer)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"bits": 5}, ValueError, "bits"),
        ({"bits": 0}, ValueError, "bits"),
        ({"bits": 16}, ValueError, "bits"),
        ({"bits": True}, TypeError, "bits"),
        ({"axis": "x"}, ValueError, "axis"),
        ({"group_size": 0}, ValueError, "group_size"),
        ({"group_size": -4}, ValueError, "group_size"),
        ({"group_size": 2.5}, TypeError, "group_size"),
    ],
)
def test_bad_config(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        UniformQuantizer(**kwargs)


def test_bad_inputs():
    q = UniformQuantizer(2, "token", 4)
    with pytest.raises(ValueError, match="rank"):
        q.quantize(torch.randn(8))
    with pytest.raises(ValueError, match="finite"):
        q.quantize(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="finite"):
        q.quantize(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        q.quantize(torch.ones(2, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        q.quantize([[1.0, 2.0]])
    with pytest.raises(ValueError, match="too large"):
        UniformQuantizer(1, "token", 4).quantize(torch.tensor([[-60000.0, 60000.0]], dtype=torch.float16))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        q.dequantize(torch.zeros(3))
    good = q.quantize(torch.randn(2, 8))
    with pytest.raises(ValueError, match="scales"):  # refused when built, before anything dequantizes it
        QuantizedTensor(good.codes, good.scales[:, :1], good.zeros[:, :1], 2, "token", 4, good.shape, good.dtype)
