"""Triton kernels == their PyTorch references, under ``TRITON_INTERPRET=1`` on CPU (conftest.py), compiled on CUDA."""

import math

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest.py set TRITON_INTERPRET=1 first when CUDA is absent

from kv_hex.kernels.reference import attention_column_sums
from kv_hex.kernels.triton_colsum import attention_column_sums_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("B", "H", "G", "T", "W"), [(1, 1, 1, 20, 20), (2, 2, 2, 37, 9), (1, 2, 4, 16, 3)])
def test_column_sums_kernel_equals_reference(B, H, G, T, W):
    g = torch.Generator().manual_seed(T + W)
    q = torch.randn(B, H * G, W, 16, generator=g).to(DEVICE)
    k = torch.randn(B, H, T, 16, generator=g).to(DEVICE)
    valid = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    if B > 1:
        valid[1, :5] = False  # left padding
    want = attention_column_sums(q, k, valid, 1 / math.sqrt(16))
    got = attention_column_sums_triton(q, k, valid, 1 / math.sqrt(16))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_column_sums_kernel_refuses_odd_head_dims():
    q, k = torch.randn(1, 1, 2, 12), torch.randn(1, 1, 2, 12)
    with pytest.raises(ValueError, match="head dim"):
        attention_column_sums_triton(q, k, torch.ones(1, 2, dtype=torch.bool), 0.3)


@pytest.mark.parametrize(
    ("axis", "dtype", "bits"),
    [
        ("channel", torch.float16, 3),
        ("token", torch.float16, 4),
        ("channel", torch.float32, 4),
        ("token", torch.float32, 3),
    ],
)
def test_kcvt_kernel_equals_reference(axis, dtype, bits):
    """Masked statistics (a third of the entries masked, one group fully masked), codes, scales, zeros: identical."""
    from kv_hex.kernels.reference import kcvt_codes
    from kv_hex.kernels.triton_kcvt import kcvt_codes_triton

    g = torch.Generator().manual_seed(bits)
    x = (torch.randn(2, 40, 48, generator=g) * 3).to(dtype).to(DEVICE)
    use = (torch.rand(2, 40, 48, generator=g) > 1 / 3).to(DEVICE)
    use[0, :, 0] = False
    use[1, 0, :] = False
    want = kcvt_codes(x, use, bits, axis)
    got = kcvt_codes_triton(x, use, bits, axis)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
