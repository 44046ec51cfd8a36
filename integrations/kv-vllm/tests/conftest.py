"""Test configuration for kv-vllm.

``TRITON_INTERPRET=1`` is set before any Triton kernel module is imported when CUDA is absent, so the paged decode
kernel the packed backend dispatches to (``test_vllm_packed_decode_v2.py``) runs on CPU tensors through the
interpreter; on a CUDA machine it runs compiled. The engine subprocesses drop the variable (``vllm_env``).
"""

from kvcore.testing.kernel_tests import interpret_triton_without_cuda

interpret_triton_without_cuda()
