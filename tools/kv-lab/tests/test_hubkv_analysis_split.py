"""HubKV's analysis modules (``theory``, ``diagnostics``) live in kv-lab: ``kv_lab.hubkv`` provides them and the
runtime package ``kv_hubkv`` neither holds nor loads them."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import kv_hubkv
import kvcore

MOVED = ("kv_hubkv.theory", "kv_hubkv.diagnostics")


def _run(code: str) -> subprocess.CompletedProcess:
    # a fresh interpreter: this process has imported kv_lab.hubkv already (the other tests of this folder)
    src = [str(Path(kv_hubkv.__file__).parents[1]), str(Path(kvcore.__file__).parents[1])]
    path = os.pathsep.join([*src, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120
    )


def test_import_loads_no_analysis_module():
    code = f"import sys, kv_hubkv\nprint(sorted(m for m in sys.modules if m.startswith('kv_lab') or m in {MOVED!r}))\n"
    res = _run(code)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", f"loaded at import: {res.stdout.strip()}"


def test_the_runtime_package_holds_no_analysis_module():
    for name in MOVED:
        assert importlib.util.find_spec(name) is None, f"{name} is back in the kv-hubkv wheel"
    assert not {"theory", "diagnostics"} & set(kv_hubkv.__all__)


def test_kv_lab_provides_them():
    from kv_lab import hubkv

    assert callable(hubkv.theory.greedy_select) and callable(hubkv.theory.perturbation_bounds)
    assert callable(hubkv.diagnostics.autocorrelation) and callable(hubkv.diagnostics.nms_coverage)
    assert {"theory", "diagnostics"} <= set(hubkv.__all__)


def test_unknown_attribute_is_an_attribute_error():
    for name in ("no_such_name", "theory", "diagnostics"):
        try:
            getattr(kv_hubkv, name)
        except AttributeError as e:
            assert name in str(e)
        else:
            raise AssertionError(f"kv_hubkv.{name} must raise AttributeError")
