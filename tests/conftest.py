"""Test configuration for the workspace-level tests.

``TRITON_INTERPRET=1`` is set before any Triton kernel module is imported when CUDA is absent, so the tests that
force a method's Triton path (``test_kivi_hf``, ``test_hex_hf``) run its kernels through the interpreter on CPU
tensors whichever test files run before them (a full run collects the packages' conftests, which set it too; a run
of this folder alone does not); on a CUDA machine the kernels run compiled.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
