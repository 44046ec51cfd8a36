"""Runs the SGLang checks (tests/engine/sglang_checks.py) against SGLang's real classes in the cached environment.

The environment is built on first use (see ``sglang_env``). If it cannot be built the test FAILS with the log; set
``KVCOMPRESS_SKIP_ENGINE_TESTS=1`` to skip it deliberately (e.g. on a machine without network access to PyPI).
"""

import os
import subprocess
import time
from pathlib import Path

import pytest
from sglang_env import OPT_OUT, build

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SRC = [ROOT / "integrations" / "kv-sglang" / "src", ROOT / "core" / "kvpages" / "src"]
SRC += [ROOT / "core" / "kvcodec" / "src", ROOT / "core" / "kvcore" / "src"]


@pytest.mark.slow
def test_sglang_real_classes():
    if os.environ.get(OPT_OUT) == "1":
        pytest.skip(f"{OPT_OUT}=1: SGLang engine checks deliberately skipped")
    t0 = time.perf_counter()
    try:
        python = build()
    except RuntimeError as e:
        pytest.fail(f"could not build the SGLang test environment ({OPT_OUT}=1 skips this test):\n{e}")
    built = time.perf_counter() - t0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, SRC))}
    env.pop("TRITON_INTERPRET", None)
    cmd = [str(python), "-m", "pytest", str(HERE / "engine" / "sglang_checks.py"), "-q", "-p", "no:cacheprovider"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    print(f"environment ready in {built:.1f} s; checks in {time.perf_counter() - t0 - built:.1f} s")
    assert r.returncode == 0, f"SGLang checks failed:\n{r.stdout[-8000:]}\n{r.stderr[-4000:]}"
    assert " passed" in r.stdout and " failed" not in r.stdout, r.stdout[-2000:]
