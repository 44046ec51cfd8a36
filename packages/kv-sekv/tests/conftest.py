"""Test configuration for kv-sekv: the Triton interpreter when CUDA is absent (set before triton is imported), and
one torch thread for the tiny tensors of these tests."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


@pytest.fixture(autouse=True)
def _single_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
