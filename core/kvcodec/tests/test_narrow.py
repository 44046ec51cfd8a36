"""kvcodec.narrow: the narrowest integer dtype for stored positions and counts, never narrower than what is held."""

import torch

from kvcodec import narrow, narrow_int


def test_narrow_int_boundaries():
    assert narrow_int(0) == narrow_int(32_767) == torch.int16
    assert narrow_int(32_768) == narrow_int(2**31 - 1) == torch.int32
    assert narrow_int(2**31) == torch.int64


def test_narrow_keeps_values_and_never_narrows_what_is_held():
    small, big = torch.tensor([-1, 0, 32_767]), torch.tensor([5, 32_768])
    assert narrow(small).dtype == torch.int16 and narrow(small).tolist() == small.tolist()
    assert narrow(big).dtype == torch.int32 and narrow(big).tolist() == big.tolist()
    assert narrow(torch.zeros(0, dtype=torch.long)).dtype == torch.int16
    held = torch.zeros(3, dtype=torch.int32)  # a store that already widened stays wide
    assert narrow(small, held, None).dtype == torch.int32
