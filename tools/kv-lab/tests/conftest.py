"""Test configuration for kv-lab: the Triton interpreter when CUDA is absent (set before triton is imported), one
torch thread for the tiny tensors of these tests, and ``lab_testkit`` importable under ``--import-mode=importlib``."""

import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _single_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
