"""Dense bit-packing: layout, bijection, errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec import pack_codes, unpack_codes
from kvcore import packed_width

BITS = list(range(1, 9))


def _stream_oracle(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The row's little-endian bit stream built as one Python integer, then cut into bytes."""
    out = []
    for row in codes.reshape(math.prod(codes.shape[:-1]), codes.shape[-1]).tolist():
        word = sum(c << (j * bits) for j, c in enumerate(row))
        width = packed_width(len(row), bits)
        out.append(list(word.to_bytes(width, "little")) if width else [])
    return torch.tensor(out, dtype=torch.uint8).reshape(*codes.shape[:-1], packed_width(codes.shape[-1], bits))


codes_args = st.tuples(st.sampled_from(BITS), st.integers(0, 3), st.integers(0, 37), st.integers(0, 2**31 - 1))


def _codes(bits, rows, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1 << bits, (rows, 2, d), generator=g, dtype=torch.int64).to(torch.uint8)


@settings(max_examples=40, deadline=None)
@given(codes_args)
def test_pack_matches_little_endian_bit_stream(args):
    bits, rows, d, seed = args
    c = _codes(bits, rows, d, seed)
    packed = pack_codes(c, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (rows, 2, packed_width(d, bits))
    assert torch.equal(packed, _stream_oracle(c, bits))


@settings(max_examples=40, deadline=None)
@given(codes_args)
def test_pack_unpack_bijection(args):
    bits, rows, d, seed = args
    c = _codes(bits, rows, d, seed)
    packed = pack_codes(c, bits)
    assert torch.equal(unpack_codes(packed, bits, d), c)
    # the other direction, on every packed array (padding bits past d*bits are zero)
    g = torch.Generator().manual_seed(seed + 1)
    raw = torch.randint(0, 256, packed.shape, generator=g, dtype=torch.int64).to(torch.uint8)
    pad = packed_width(d, bits) * 8 - d * bits
    if raw.shape[-1] and pad:
        raw[..., -1] &= (1 << (8 - pad)) - 1
    assert torch.equal(pack_codes(unpack_codes(raw, bits, d), bits), raw)


def test_three_bits_pack_eight_codes_in_three_bytes():
    c = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0, 7]], dtype=torch.uint8)
    packed = pack_codes(c, 3)
    assert packed.shape == (1, 4)  # 27 bits -> 4 bytes; the first 8 codes fill exactly 3 bytes
    word = sum(v << (3 * j) for j, v in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert packed[0, :3].tolist() == list(word.to_bytes(3, "little"))
    assert packed[0, 3].item() == 7


@pytest.mark.parametrize(("bits", "err"), [(0, ValueError), (9, ValueError), (2.0, TypeError), (True, TypeError)])
def test_bad_bits(bits, err):
    with pytest.raises(err, match="bits"):
        pack_codes(torch.zeros(4, dtype=torch.uint8), bits)
    with pytest.raises(err, match="bits"):
        unpack_codes(torch.zeros(1, dtype=torch.uint8), bits, 4)


def test_bad_codes():
    with pytest.raises(ValueError, match="codes must be < 2\\*\\*bits"):
        pack_codes(torch.tensor([0, 4], dtype=torch.uint8), 2)
    with pytest.raises(TypeError, match="codes must be uint8"):
        pack_codes(torch.tensor([0, 1]), 2)
    with pytest.raises(TypeError, match="codes must be a torch.Tensor"):
        pack_codes([0, 1], 2)
    with pytest.raises(ValueError, match="packed must have shape"):
        unpack_codes(torch.zeros(3, dtype=torch.uint8), 2, 16)
    with pytest.raises(TypeError, match="packed must be uint8"):
        unpack_codes(torch.zeros(4, dtype=torch.int32), 2, 16)
