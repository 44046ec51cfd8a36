"""Fused quantized decode attention: the reference equals kvcore.reference_attention over the dequantized K/V, and
the Triton kernel equals the reference (interpreter on CPU, tiny shapes)."""

import pytest
import torch

from kvcodec import QuantizedSegment, UniformQuantizer, quantized_attention
from kvcodec.attention import CodeRows
from kvcore import KVView, merge_attention, reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(B, H, T, D, bits, G, lengths=None, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=gen).to(dtype)
    v = torch.randn(B, H, T, D, generator=gen).to(dtype)
    qk = UniformQuantizer(bits, "channel", G).quantize(k)
    qv = UniformQuantizer(bits, "token", G).quantize(v)
    bias = torch.zeros(B, H, T)
    if lengths is not None:
        bias = torch.where(torch.arange(T) < torch.tensor(lengths).view(B, H, 1), 0.0, float("-inf"))
    kd = UniformQuantizer(bits, "channel", G).dequantize(qk)
    vd = UniformQuantizer(bits, "token", G).dequantize(qv)
    pos = torch.where(bias == 0, torch.arange(T), -1)
    return QuantizedSegment.from_dense(qk, qv, bias), KVView(kd, vd, pos, bias)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_matches_reference_attention_over_dequantized(bits, group, dtype):
    """Code rows dequantize exactly as ``UniformQuantizer.dequantize`` (rounded to the cache dtype), so the fused
    attention equals attention over the dequantized cache to fp32 accuracy, whatever the cache dtype."""
    seg, view = _case(2, 2, 11, 12, bits, 4, lengths=[[11, 5], [0, 8]], seed=bits, dtype=dtype)
    q = torch.randn(2, 2 * group, 3, 12, generator=torch.Generator().manual_seed(1))
    out, lse = quantized_attention(q, seg, 0.3)
    ref_out, ref_lse = reference_attention(view, q, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert bool(torch.isinf(lse[1, :group]).all()) and bool((out[1, :group] == 0).all())  # the empty head


def test_residual_is_merged():
    seg, view = _case(1, 2, 9, 8, 2, 4, seed=3)
    gen = torch.Generator().manual_seed(4)
    rk, rv = torch.randn(1, 2, 5, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)
    res = KVView(rk, rv, torch.arange(5).expand(1, 2, 5), torch.zeros(1, 2, 5))
    q = torch.randn(1, 4, 1, 8, generator=gen)
    out, lse = quantized_attention(q, seg, residual=res)
    full = KVView(
        torch.cat([view.keys, rk], 2),
        torch.cat([view.values, rv], 2),
        torch.cat([view.positions, res.positions + 9], 2),
        torch.zeros(1, 2, 14),
    )
    ref_out, ref_lse = reference_attention(full, q)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, merge_attention([reference_attention(view, q), reference_attention(res, q)])[0])


def test_mixed_full_and_quantized_rows():
    """Entries whose key is quantized but value is full precision (and the reverse) through the index maps."""
    seg, view = _case(1, 1, 6, 8, 4, 2, seed=5)
    gen = torch.Generator().manual_seed(6)
    full = torch.randn(3, 8, generator=gen)
    vrow = seg.value_row.clone()
    vrow[0, 0, 1], vrow[0, 0, 4] = -1, -3  # values of entries 1 and 4 are full rows 0 and 2
    values = CodeRows(seg.values.codes, seg.values.scales, seg.values.zeros, 4, "token", 2, full)
    mixed = QuantizedSegment(seg.keys, values, seg.key_row, seg.key_group, vrow, seg.value_group, seg.bias)
    v = view.values.clone()
    v[0, 0, 1], v[0, 0, 4] = full[0], full[2]
    q = torch.randn(1, 1, 2, 8, generator=gen)
    out, lse = quantized_attention(q, mixed)
    ref = reference_attention(KVView(view.keys, v, view.positions, view.logit_bias), q)
    torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref[1], rtol=1e-5, atol=1e-5)


def test_dequantized_rows_are_rounded_to_the_cache_dtype():
    """The attention's dequantization equals ``UniformQuantizer.dequantize`` bit for bit (fp16/bf16 caches)."""
    from kvcodec.kernels.reference import dequantize_rows_ref

    for dtype in (torch.float16, torch.bfloat16):
        for bits in (2, 4, 8):
            seg, view = _case(1, 2, 9, 8, bits, 4, seed=20 + bits, dtype=dtype)
            k = dequantize_rows_ref(seg.keys, seg.key_row, seg.key_group)
            v = dequantize_rows_ref(seg.values, seg.value_row, seg.value_group)
            assert torch.equal(k, view.keys.float()) and torch.equal(v, view.values.float())


def test_rejects_bad_query():
    seg, _ = _case(1, 2, 4, 8, 2, 4)
    with pytest.raises(ValueError, match="query"):
        quantized_attention(torch.randn(1, 3, 1, 8), seg)  # 3 query heads over 2 KV heads
    with pytest.raises(TypeError, match="segment"):
        quantized_attention(torch.randn(1, 2, 1, 8), "not a segment")


def _to(seg, device):
    def side(s):
        return CodeRows(
            s.codes.to(device), s.scales.to(device), s.zeros.to(device), s.bits, s.axis, s.group_size, s.full.to(device)
        )

    return QuantizedSegment(
        side(seg.keys),
        side(seg.values),
        *(t.to(device) for t in (seg.key_row, seg.key_group, seg.value_row, seg.value_group, seg.bias)),
    )
