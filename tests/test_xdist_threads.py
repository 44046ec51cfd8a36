"""The workspace conftest gives each pytest-xdist worker ``cores // workers`` torch threads (see its docstring)."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def _conftest():
    spec = importlib.util.spec_from_file_location("workspace_conftest", ROOT_CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("environ", "cores", "want"),
    [
        ({}, 16, None),  # not under xdist: torch's default
        ({"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": "14"}, 16, 1),
        ({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "4"}, 16, 4),
        ({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "32"}, 16, 1),  # never fewer than one
        ({"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "4", "OMP_NUM_THREADS": "8"}, 16, None),
    ],
)
def test_threads_per_worker(environ, cores, want):
    assert _conftest().threads_per_worker(environ, cores) == want


def test_a_worker_process_runs_with_its_share_of_threads():
    """Importing the conftest in a process that looks like an xdist worker sets torch's intra-op threads."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env |= {"PYTEST_XDIST_WORKER": "gw0", "PYTEST_XDIST_WORKER_COUNT": str(4 * (os.cpu_count() or 1))}
    code = (
        "import importlib.util, torch, sys\n"
        f"spec = importlib.util.spec_from_file_location('c', {str(ROOT_CONFTEST)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "print(torch.get_num_threads())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
