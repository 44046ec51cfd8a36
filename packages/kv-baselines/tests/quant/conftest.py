"""``TRITON_INTERPRET`` must be set before any ``@triton.jit`` kernel module is imported, so kvcodec's Triton kernels
run on CPU tensors through the interpreter; on a CUDA machine the variable is left alone (compiled kernels)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
