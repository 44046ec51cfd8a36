"""The workspace runs pytest with ``--import-mode=importlib``; make ``kvhf_testkit`` importable."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _single_torch_thread(request):
    """The adapter tests (``test_hf_*``) run tiny models: intra-op threads only add wake-up latency on the
    2-core CI box. Other tests in this folder (real-model checks) keep the thread count."""
    if not Path(str(request.node.fspath)).name.startswith("test_hf_"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
