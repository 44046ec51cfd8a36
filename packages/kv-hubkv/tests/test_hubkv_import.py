"""``import kv_hubkv`` works without triton (an optional extra) and falls back to the reference."""

from __future__ import annotations

import os


def test_import_and_cpu_refine_work_without_triton():
    # a fresh interpreter in which `import triton` fails: the package imports, dispatches to the
    # reference, and the Triton launcher explains what is missing
    import subprocess
    import sys
    from pathlib import Path

    import kv_hubkv

    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch, kv_hubkv\n"
        "assert not kv_hubkv.HAS_TRITON\n"
        "s = torch.rand(2, 3, 20)\n"
        "assert torch.equal(kv_hubkv.refine(s, 0.9), kv_hubkv.refine_torch(s, 0.9))\n"
        "try:\n"
        "    kv_hubkv.refine_triton(s, 0.9)\n"
        "except RuntimeError as e:\n"
        "    assert 'triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('refine_triton must raise without triton')\n"
        "print('ok')\n"
    )
    src = str(Path(kv_hubkv.__file__).parents[1])
    import kvcore

    path = os.pathsep.join([src, str(Path(kvcore.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
