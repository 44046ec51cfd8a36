"""Set-up shared by the test folders of members with Triton kernels (imported from their ``conftest.py``).

:func:`interpret_triton_without_cuda` must run before anything imports ``triton``: Triton reads
``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function (its own ``tl`` helpers included), so on a machine
without CUDA the kernels then run on CPU tensors through the interpreter and are compared with their PyTorch
references; on a CUDA machine the variable is left alone and the kernels run compiled. :func:`single_torch_thread`
is an autouse fixture once imported into a ``conftest.py``: the tests' tiny tensors gain nothing from intra-op
threads, which only add OpenMP wake-up latency on a small CPU box.

Usage, in a member's ``tests/conftest.py``::

    from kvcore.testing.kernel_tests import interpret_triton_without_cuda, single_torch_thread  # noqa: F401

    interpret_triton_without_cuda()
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

__all__ = ["interpret_triton_without_cuda", "single_torch_thread"]


def interpret_triton_without_cuda() -> bool:
    """Set ``TRITON_INTERPRET=1`` (unless already set) when CUDA is absent; return whether the interpreter is on."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """One torch thread during each test, the previous count restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
