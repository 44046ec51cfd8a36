"""Test configuration for kv-hubkv.

``TRITON_INTERPRET=1`` must be set before ``triton`` and :mod:`kv_hubkv.triton_kernel` are imported
(Triton reads it when ``@triton.jit`` decorates a function, including its own ``tl`` helpers), so
the Triton kernel can be compared with the PyTorch reference on CPU tensors. If another package
imported triton earlier in the session without it, the kernel tests skip and say so. On a CUDA
machine the variable is left alone and the kernel tests run compiled on the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest


@pytest.fixture(autouse=True)
def _single_torch_thread():
    """Tiny tensors: intra-op threads only add OpenMP wake-up latency (10-80 ms per op on the
    2-core CI box). Scoped to this package's tests and restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
