"""``import kv_hubkv`` is cheap: the analysis modules (``theory``, ``diagnostics``) load on first access only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kv_hubkv
import kvcore

LAZY = ("kv_hubkv.theory", "kv_hubkv.diagnostics")


def _run(code: str) -> subprocess.CompletedProcess:
    # a fresh interpreter: this process has imported the test modules of theory / diagnostics already
    src = [str(Path(kv_hubkv.__file__).parents[1]), str(Path(kvcore.__file__).parents[1])]
    path = os.pathsep.join([*src, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=120
    )


def test_import_does_not_load_theory_or_diagnostics():
    code = f"import sys, kv_hubkv\nprint(sorted(m for m in {LAZY!r} if m in sys.modules))\n"
    res = _run(code)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", f"loaded at import: {res.stdout.strip()}"


def test_attribute_access_loads_the_submodule_once():
    code = (
        "import sys, kv_hubkv\n"
        "t = kv_hubkv.theory\n"
        "assert 'kv_hubkv.theory' in sys.modules and 'kv_hubkv.diagnostics' not in sys.modules\n"
        "assert t is sys.modules['kv_hubkv.theory'] and kv_hubkv.theory is t\n"
        "assert callable(t.greedy_select)\n"
        "from kv_hubkv import diagnostics\n"
        "assert diagnostics is sys.modules['kv_hubkv.diagnostics'] and callable(diagnostics.autocorrelation)\n"
        "print('ok')\n"
    )
    res = _run(code)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_unknown_attribute_is_an_attribute_error():
    try:
        kv_hubkv.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("kv_hubkv.no_such_name must raise AttributeError")


def test_lazy_names_are_listed():
    assert {"theory", "diagnostics"} <= set(kv_hubkv.__all__)
    assert {"theory", "diagnostics"} <= set(dir(kv_hubkv))
