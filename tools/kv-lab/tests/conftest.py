"""Test configuration for kv-lab: the Triton interpreter when CUDA is absent (set before triton is imported), one
torch thread for the tiny tensors of these tests, and ``lab_testkit`` importable under ``--import-mode=importlib``."""

import sys
from pathlib import Path

from kvcore.testing.kernel_tests import interpret_triton_without_cuda, single_torch_thread  # noqa: F401

interpret_triton_without_cuda()


sys.path.insert(0, str(Path(__file__).parent))
