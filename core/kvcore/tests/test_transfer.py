"""kvcore.from_host: Python data to a device without a host sync."""

import pytest
import torch

from kvcore import from_host
from kvcore.testing.host_reads import HostReads


@pytest.mark.parametrize("dtype", [None, torch.int32, torch.float16])
def test_equals_torch_tensor(dtype):
    data = [[1, 2, 3], [4, 5, 6]]
    got = from_host(data, torch.device("cpu"), dtype=dtype)
    want = torch.tensor(data, dtype=dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)


def test_counts_no_host_read():
    with HostReads(sites=True) as reads:
        from_host([1, 2], torch.device("cpu"))
        torch.tensor([1, 2], device=torch.device("cpu"))  # what it replaces: counted
    assert reads.total == 1 and all("test_transfer" in site for site, _ in reads.by_site), dict(reads.by_site)


def test_other_devices_get_a_copy_there():
    got = from_host([1.5, 2.5], "meta")
    assert got.device.type == "meta" and got.shape == (2,) and got.dtype == torch.float32


def test_a_tensor_is_refused():
    with pytest.raises(TypeError, match="already a tensor"):
        from_host(torch.arange(3), "cpu")
