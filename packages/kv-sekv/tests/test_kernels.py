"""Triton Stage-1 attention == the PyTorch reference under TRITON_INTERPRET=1 (compiled on a GPU)."""

import math
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from kv_sekv.kernels import biased_attention_torch
from kv_sekv.kernels.triton_attention import HAS_TRITON, biased_attention_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)


@pytest.mark.parametrize(("B", "Hkv", "group", "Q", "N", "D"), [(1, 1, 1, 1, 5, 8), (2, 2, 2, 2, 40, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biased_attention_matches_reference(B, Hkv, group, Q, N, D, dtype):
    """Random bias with -inf padding and log|S| entries, a head with no entry (lse -inf, out 0), bf16 inputs."""
    assert HAS_TRITON
    g = torch.Generator().manual_seed(N)
    k = torch.randn(B, Hkv, N, D, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(B, Hkv, N, D, generator=g).to(dtype).to(DEVICE)
    bias = torch.log(torch.randint(1, 20, (B, Hkv, N), generator=g).float())
    bias[..., ::3] = float("-inf")
    bias[0, 0] = float("-inf")  # an empty head
    bias = bias.to(DEVICE)
    q = torch.randn(B, Hkv * group, Q, D, generator=g).to(dtype).to(DEVICE)
    got = biased_attention_triton(k, v, bias, q, 1 / math.sqrt(D), block_n=32)
    want = biased_attention_torch(k, v, bias, q, 1 / math.sqrt(D))
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)
    assert bool((got[1][0, :group] == float("-inf")).all()) and bool((got[0][0, :group] == 0).all())
