"""Test configuration for kv-hqekv.

``TRITON_INTERPRET=1`` is set before any Triton kernel module is imported when CUDA is absent, so the Triton kernels
run on CPU tensors through the interpreter and are compared with their PyTorch references; on a CUDA machine the
variable is left alone and the kernels run compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(autouse=True)
def _single_torch_thread():
    """Tiny tensors: intra-op threads only add wake-up latency on a small CPU box; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
