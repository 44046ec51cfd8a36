"""The value FIFO's specialised per-token quantizer equals kvcodec's UniformQuantizer bit for bit."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_baselines.quant import token_quant
from kv_baselines.quant.token_quant import fast_tokens, quantize_tokens
from kvcodec import UniformQuantizer


@settings(max_examples=60, deadline=None)
@given(
    M=st.integers(0, 6),
    D=st.sampled_from([1, 5, 16, 32, 48, 64, 96]),
    bits=st.sampled_from([1, 2, 3, 4, 8]),
    G=st.sampled_from([1, 4, 16, 32, 64]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    log_scale=st.integers(-6, 6),
    constant=st.booleans(),
    seed=st.integers(0, 2**16),
    triton=st.booleans(),
)
def test_quantize_tokens_equals_uniform_quantizer(M, D, bits, G, dtype, log_scale, constant, seed, triton):
    # invariant: for every finite input the codes, scales and zeros are identical (dtype, shape and bits) to the
    # generic quantizer's on the same rows as [M, 1, D] (one token per unit), on the fast and fallback paths and on
    # the CUDA path (kvcodec's fused Triton kernel; forced here, the interpreter computes it)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g) * 2.0**log_scale + torch.randn(M, 1, generator=g)
    if constant:
        x[:, :] = x[:, :1]
    x = x.to(dtype)
    if triton:
        pytest.importorskip("triton")
    with mock.patch.object(token_quant, "use_triton", lambda t: triton):
        codes, scales, zeros = quantize_tokens(x, bits, G)
    ref = UniformQuantizer(bits, "token", G).quantize(x[:, None])
    assert codes.dtype == torch.uint8 and scales.dtype == ref.scales.dtype and zeros.dtype == ref.zeros.dtype
    assert torch.equal(codes, ref.codes.reshape(M, ref.codes.shape[-1]))
    assert torch.equal(scales, ref.scales)
    assert torch.equal(zeros, ref.zeros)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_kivi_shapes_take_the_word_path(bits):
    # KIVI's values (d = 64 or 128, G = 32) pack by 32-bit words; a partial group or 3 bits does not
    assert fast_tokens(64, bits, 32) and fast_tokens(128, bits, 32)
    assert not fast_tokens(48, bits, 32)
    assert not fast_tokens(64, 3, 32)
