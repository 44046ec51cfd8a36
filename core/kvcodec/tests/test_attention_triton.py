"""The Triton quantized-attention kernel equals the PyTorch reference (interpreter on CPU: tiny shapes, few blocks)."""

import pytest
import torch
from test_attention import DEVICE, _case, _to

from kvcodec.attention import CodeRows, QuantizedSegment
from kvcodec.kernels.reference import quantized_attention_ref

triton = pytest.importorskip("triton")
from kvcodec.kernels.triton_attention import quantized_attention_triton


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
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


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_whole_byte_widths_at_a_power_of_two_head_dim(bits, dtype):
    # head dim 32, widths that divide a byte: each code row is read as one run of bytes and split into its lanes
    # (the path a padded head dim or a 3-bit width does not take); the result is the reference's
    seg, _ = _case(2, 2, 9, 32, bits, 4, lengths=[[9, 4], [1, 7]], seed=20 + bits, dtype=dtype)
    seg = _to(seg, DEVICE)
    q = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    out, lse = quantized_attention_triton(q, seg, 0.2, block_t=4)
    ref_out, ref_lse = quantized_attention_ref(q, seg, 0.2)
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


@pytest.mark.parametrize(("block_t", "tiles"), [(16, 1), (16, 2), (32, 1), (16, 4)])
def test_triton_any_split_matches_reference(block_t, tiles):
    # one program per split of the head's entries (3, 2, 2 and 1 splits here), merged by log-sum-exp in a second
    # kernel: the result must not depend on the split
    seg, _ = _case(2, 2, 40, 12, 4, 4, lengths=[[40, 23], [0, 37]], seed=21, dtype=torch.float16)
    seg = _to(seg, DEVICE)
    q = torch.randn(2, 4, 1, 12, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    out, lse = quantized_attention_triton(q, seg, 0.3, block_t=block_t, tiles=tiles)
    ref_out, ref_lse = quantized_attention_ref(q, seg, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_split_plan_aims_at_enough_programs_and_checks_tiles():
    from kvcodec.kernels.triton_attention import TARGET_PROGRAMS, split_plan

    bt, tiles, splits = split_plan(16384, 8)  # one sequence, 8 KV heads: a decode step
    assert bt * tiles * splits >= 16384 > bt * tiles * (splits - 1)
    assert 8 * splits >= TARGET_PROGRAMS // 2  # enough programs to fill a GPU
    assert split_plan(16384, 4096)[2] <= split_plan(16384, 8)[2]  # many heads: longer splits
    assert split_plan(5, 1) == (16, 1, 1)  # tiles of at least 16 entries (tl.dot)
    with pytest.raises(ValueError, match="tiles"):
        split_plan(64, 1, tiles=0)


def test_tensor_core_path_matches_reference_and_checks_dtypes():
    """The cache-dtype matrix-unit path (float16 query and cache; probabilities split into two float16 parts) stays
    within float32-level error of the reference: one cast of p to float16 would be off by ~1e-3. (Its bfloat16
    twin runs on GPUs only: the interpreter's bfloat16 tl.dot is wrong.)"""
    seg, _ = _case(1, 2, 40, 16, 2, 8, seed=31, dtype=torch.float16)
    seg = _to(seg, DEVICE)
    q = (torch.randn(1, 4, 1, 16, generator=torch.Generator().manual_seed(6)) * 3).to(DEVICE, torch.float16)
    out, lse = quantized_attention_triton(q, seg, 0.3, tensor_cores=True)
    ref_out, ref_lse = quantized_attention_ref(q, seg, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="tensor_cores"):
        quantized_attention_triton(q.float(), seg, 0.3, tensor_cores=True)


@pytest.mark.parametrize("nsplit", [2, 5, 13, 64, 70])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_merge_splits_in_chunks_equals_the_log_sum_exp_merge(nsplit, chunk):
    """The merge kernel holds ``chunk`` splits at a time and rescales its running sum online: whatever the chunk,
    the result is the log-sum-exp merge of the splits (splits that saw nothing, ``lse = -inf``, weigh 0; a row no
    split saw gives 0 and ``-inf``)."""
    from kvcodec.kernels.triton_attention import merge_splits

    g = torch.Generator().manual_seed(nsplit * 7 + chunk)
    S, M, D = 3, 2, 24
    outp = torch.randn(S, nsplit, M, D, generator=g)
    lsep = 4 * torch.randn(S, nsplit, M, generator=g)
    lsep[0, ::2, 0] = float("-inf")  # empty splits
    lsep[1, :, 1] = float("-inf")  # a row nothing saw
    out, lse = merge_splits(outp.to(DEVICE), lsep.to(DEVICE), chunk=chunk)
    want_lse = torch.logsumexp(lsep, dim=1)
    w = torch.exp(lsep - torch.where(torch.isfinite(want_lse), want_lse, 0.0)[:, None])
    want = (w[..., None] * outp).sum(1)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu(), want_lse, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1, 1].cpu(), torch.zeros(D)) and lse[1, 1].item() == float("-inf")


def test_merge_splits_rejects_a_chunk_that_is_not_a_power_of_two():
    from kvcodec.kernels.triton_attention import merge_splits

    with pytest.raises(ValueError, match="chunk must be a power of two"):
        merge_splits(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1), chunk=3)
