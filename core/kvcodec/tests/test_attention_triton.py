"""The Triton quantized-attention kernel equals the PyTorch reference (interpreter on CPU: tiny shapes, few blocks)."""

import pytest
import torch
from test_attention import DEVICE, _case, _to

from kvcodec.attention import CodeRows, QuantizedSegment
from kvcodec.kernels.reference import quantized_attention_ref

triton = pytest.importorskip("triton")
from kvcodec.kernels.triton_attention import quantized_attention_triton


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_reference(bits, group, dtype):
    seg, _ = _case(2, 2, 7, 12, bits, 4, lengths=[[7, 3], [0, 6]], seed=10 + bits, dtype=dtype)
    seg = _to(seg, DEVICE)
    q = torch.randn(2, 2 * group, 2, 12, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    out, lse = quantized_attention_triton(q, seg, 0.25, block_t=4)  # two T blocks, the last one partial
    ref_out, ref_lse = quantized_attention_ref(q, seg, 0.25)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_triton_mixed_rows_and_3_bits():
    seg, _ = _case(1, 1, 5, 10, 3, 4, seed=7)
    full = torch.randn(2, 10, generator=torch.Generator().manual_seed(8))
    krow = seg.key_row.clone()
    krow[0, 0, 2] = -2
    keys = CodeRows(seg.keys.codes, seg.keys.scales, seg.keys.zeros, 3, "channel", 4, full)
    seg = _to(QuantizedSegment(keys, seg.values, krow, seg.key_group, seg.value_row, seg.value_group, seg.bias), DEVICE)
    q = torch.randn(1, 1, 1, 10, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    out, lse = quantized_attention_triton(q, seg, 0.5, block_t=8)
    ref_out, ref_lse = quantized_attention_ref(q, seg, 0.5)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)
