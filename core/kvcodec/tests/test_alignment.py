"""rows_aligned: the host check behind the kernels' ALIGNED hint (strides multiples of 16, base 16-byte aligned)."""

import torch

from kvcodec.kernels.alignment import rows_aligned


def test_strides_and_base_must_both_be_aligned():
    buf = torch.zeros(4, 3, 32, 16)
    assert rows_aligned((buf,))  # strides 1536, 512, 16 elements; a fresh allocation is aligned
    assert not rows_aligned((buf[..., :8].contiguous().view(4, 3, 32, 8),))  # row stride 8
    assert rows_aligned((buf.view(4, 3, 32, 16)[:, :, 1:],), dims=(0, 1))  # base moved by 16 floats: aligned
    assert not rows_aligned((buf.flatten()[1:].view(-1)[: 4 * 3 * 32 * 15].view(4, 3, 32, 15),), dims=(0,))


def test_only_the_named_dimensions_count_and_every_tensor_must_pass():
    odd = torch.zeros(2, 17, 16)  # stride(0) = 272 (multiple of 16), stride(1) = 16
    assert rows_aligned((odd,), dims=(0, 1))
    rows7 = torch.zeros(2, 3, 7)  # strides 21, 7
    assert not rows_aligned((rows7,), dims=(0,))
    assert rows_aligned((rows7,), dims=())  # nothing named: the base alone
    assert not rows_aligned((odd, rows7))  # one tensor failing fails the set
    assert rows_aligned(())
