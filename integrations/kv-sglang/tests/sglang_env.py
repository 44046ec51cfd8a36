"""Builds and caches the SGLang environment the engine tests run in, outside the workspace lock.

SGLang publishes no CPU wheel and pins CUDA torch, so the environment holds ``sglang`` installed with ``--no-deps``
plus the light packages its storage and host-pool modules import, and reuses the workspace's own torch (and the rest
of its site-packages) through a ``.pth`` file. It lives under ``~/.cache/kvcompress/engines/sglang-<hash>``
(``KVCOMPRESS_ENGINE_CACHE`` overrides the root), keyed by a hash of the requirements, the Python version and the
workspace site-packages; it is built once (about 10 s with a warm uv cache) and reused. Never add ``torchvision``:
its PyPI build pulls CUDA torch (several GB).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SGLANG = "sglang==0.5.23"
LIGHT_DEPS = [
    "orjson==3.13.0",
    "pybase64==1.5.1",
    "starlette==1.10.0",
    "msgspec==0.22.0",
    "pyzmq==27.3.0",
    "ipython==9.18.1",
    "aiohttp==3.14.5",
    "dill==0.4.1",
]
OPT_OUT = "KVCOMPRESS_SKIP_ENGINE_TESTS"


def env_dir() -> Path:
    root = Path(os.environ.get("KVCOMPRESS_ENGINE_CACHE", Path.home() / ".cache" / "kvcompress" / "engines"))
    purelib = sysconfig.get_paths()["purelib"]
    spec = "\n".join([SGLANG, *LIGHT_DEPS, sys.version, purelib])
    return root / f"sglang-{hashlib.sha256(spec.encode()).hexdigest()[:16]}"


def python_of(env: Path) -> Path:
    return env / "bin" / "python"


def build() -> Path:
    """The environment's python, building the environment first if needed. Raises RuntimeError with the log."""
    env = env_dir()
    if python_of(env).exists() and (env / ".complete").exists():
        return python_of(env)
    uv = shutil.which("uv")
    if uv is None:
        raise RuntimeError("building the SGLang test environment needs `uv` on PATH (pip install uv)")
    env.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=env.name + ".tmp-", dir=env.parent))
    steps = [
        [uv, "venv", "-q", "--python", sys.executable, str(tmp)],
        [uv, "pip", "install", "-q", "--python", str(python_of(tmp)), "--no-deps", SGLANG],
        [uv, "pip", "install", "-q", "--python", str(python_of(tmp)), *LIGHT_DEPS],
    ]
    try:
        for i, cmd in enumerate(steps):
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode:
                raise RuntimeError(f"command {cmd} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
            if i == 0:  # reuse the workspace's torch and packages, after the environment's own
                site = subprocess.run(
                    [str(python_of(tmp)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.strip()
                Path(site, "_kvcompress_workspace.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        leaked = [p for p in ("torch", "torchvision") if list(Path(site).glob(f"{p}-*.dist-info"))]
        if leaked:
            raise RuntimeError(f"the SGLang test environment must reuse the workspace torch, but installed {leaked}")
        (tmp / ".complete").write_text("ok\n")
        try:
            tmp.rename(env)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return python_of(env)
