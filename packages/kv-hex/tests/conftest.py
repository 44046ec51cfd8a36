"""Test configuration for kv-hex.

``TRITON_INTERPRET=1`` is set before any Triton kernel module is imported when CUDA is absent, so the Triton
kernels run on CPU tensors through the interpreter; on a CUDA machine the kernels run compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(autouse=True)
def _single_torch_thread():
    """Tiny tensors: intra-op threads only add latency on a small CI box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
