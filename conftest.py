"""Workspace-wide pytest set-up: hypothesis profiles and torch's CPU threads under pytest-xdist.

``HYPOTHESIS_PROFILE=ci`` (set by ``.ci/run``) loads a derandomized profile: every property test draws the same
examples on every run, so a CI result can be reproduced exactly. Without it (a developer's ``uv run pytest``),
hypothesis draws fresh examples each run and keeps exploring.

Under pytest-xdist (``pytest -n N``) every worker would otherwise start torch with one intra-op thread per core, so
``N`` workers run ``N x cores`` spinning OpenMP threads on ``cores`` cores: CPU-bound tests of many small operations
slow down by an order of magnitude (a KIVI conformance test took 0.6 s alone, 16-21 s in each of six processes
sharing two cores with two threads each, 2.1-2.6 s with one). Each worker gets ``cores // N`` threads (at least
one) unless ``OMP_NUM_THREADS`` says otherwise.
"""

import os

import torch
from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])


def threads_per_worker(environ: dict[str, str], cores: int) -> int | None:
    """torch's intra-op threads for this process: ``cores // workers`` (at least 1) in a pytest-xdist worker whose
    environment does not set ``OMP_NUM_THREADS``; ``None`` (leave torch's default) otherwise."""
    workers = environ.get("PYTEST_XDIST_WORKER_COUNT")
    if "PYTEST_XDIST_WORKER" not in environ or not workers or "OMP_NUM_THREADS" in environ:
        return None
    return max(1, cores // max(1, int(workers)))


_threads = threads_per_worker(dict(os.environ), os.cpu_count() or 1)
if _threads is not None:
    torch.set_num_threads(_threads)
