"""Test configuration for kv-hubkv.

``TRITON_INTERPRET=1`` must be set before ``triton`` and :mod:`kv_hubkv.triton_kernel` are imported
(Triton reads it when ``@triton.jit`` decorates a function, including its own ``tl`` helpers), so
the Triton kernel can be compared with the PyTorch reference on CPU tensors. If another package
imported triton earlier in the session without it, the kernel tests skip and say so. On a CUDA
machine the variable is left alone and the kernel tests run compiled on the GPU.
"""

from kvcore.testing.kernel_tests import interpret_triton_without_cuda, single_torch_thread  # noqa: F401

interpret_triton_without_cuda()
