"""Test configuration for kv-hex.

``TRITON_INTERPRET=1`` is set before any Triton kernel module is imported when CUDA is absent, so the Triton
kernels run on CPU tensors through the interpreter; on a CUDA machine the kernels run compiled.
"""

from kvcore.testing.kernel_tests import interpret_triton_without_cuda, single_torch_thread  # noqa: F401

interpret_triton_without_cuda()
