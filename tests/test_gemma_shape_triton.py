"""Gemma 3 270M's attention shape through every method's Triton kernels (interpreter on CPU).

Gemma 3 has one KV head of 256 channels under 4 query heads, and sliding-window layers beside global ones. The
invariant: on a tiny hybrid model of that shape, kv-hf's prefill and greedy decode give the same logits (and tokens)
whether every dispatch point takes the PyTorch references or the Triton kernels (``TRITON_INTERPRET=1``, forced by
``benchmarks/decode_census.py``'s ``DISPATCH``). The run happens in a fresh interpreter
(``tests/gemma_shape_triton_run.py``): Triton reads ``TRITON_INTERPRET`` when it is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# one method per kernel family: KIVI's decode layout (kvcodec), HqeKV's tiers, HEX's segments, HubKV's refinement,
# SEKV's surprisal / summaries / routing
METHODS = ("kivi-2", "hqekv-2", "hex-3", "hubkv-snapkv", "sekv")


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "gemma_shape_triton_run.py"), *METHODS],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_dispatch_point_was_forced(results):
    assert len(results["patched"]) >= 10, results["patched"]


@pytest.mark.parametrize("method", METHODS)
def test_triton_kernels_match_the_references_at_gemma_shapes(results, method):
    r = results[method]
    assert r["max_ref"] > 0  # the logits are not all zero (the comparison means something)
    assert r["max_abs"] <= 1e-3 * max(1.0, r["max_ref"]), r
    assert r["tokens_equal"], r
