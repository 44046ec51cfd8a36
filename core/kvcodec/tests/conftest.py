"""Setup of the quantization tests.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel module is imported, so the Triton
kernels run on CPU tensors through the interpreter. On a CUDA machine the
variable is left alone, so the kernels run compiled on the GPU. The repository runs pytest
with ``--import-mode=importlib``, so this folder is put on ``sys.path`` for the shared ``quant_testutil``.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
