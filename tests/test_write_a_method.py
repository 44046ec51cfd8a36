"""docs/write-a-method.md, section 2b, followed for a toy member: its steps make a method that ``kvbench --list`` shows.

In a temporary copy of the workspace's metadata (the root ``pyproject.toml`` and ``uv.lock``, every member's
``pyproject.toml``) the test writes the package the doc shows — its ``pyproject.toml`` and ``registry.py`` taken from
the doc's code blocks — and applies the doc's root-``pyproject.toml`` snippet to the three lists it names. Then:

* ``uv lock --offline`` (what ``uv sync`` does first) resolves the workspace with the new member and records it as a
  dependency of the root, which is what makes ``uv sync`` install it (the ``members`` glob alone only locks it);
* the member is installed the way ``uv sync`` would, as a built wheel, but into a folder of its own
  (``uv pip install --offline --no-deps --target``) rather than into the shared ``.venv`` every test runs in, and
  ``kvbench --list`` run with that folder on ``PYTHONPATH`` lists ``keynorm`` with the doc's description.

Offline (uv's cache holds hatchling), about 20 s on the 2-core VM, most of it kvbench importing torch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "write-a-method.md"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
MEMBER, MODULE = "kv-keynorm", "kv_keynorm"

UV = os.environ.get("UV") or shutil.which("uv")  # `uv run` names itself in $UV
pytestmark = pytest.mark.skipif(UV is None, reason="needs uv (the workspace's tool)")


def block(language: str, marker: str) -> str:
    """The one ``language`` code block of the doc containing ``marker``."""
    found = [body for lang, body in FENCE.findall(DOC.read_text()) if lang == language and marker in body]
    assert len(found) == 1, f"write-a-method.md: expected one {language} block with {marker!r}, found {len(found)}"
    return found[0]


def copy_metadata(dest: Path) -> None:
    """The workspace root's pyproject.toml and uv.lock and each member's pyproject.toml (what uv lock reads)."""
    for name in ("pyproject.toml", "uv.lock"):
        shutil.copy(ROOT / name, dest / name)
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["uv"]["workspace"]["members"]
    for pattern in globs:
        for project in ROOT.glob(f"{pattern}/pyproject.toml"):
            target = dest / project.relative_to(ROOT)
            target.parent.mkdir(parents=True)
            shutil.copy(project, target)


def apply_root_snippet(pyproject: Path, snippet: dict) -> None:
    """Add the snippet's list items and table entries to the root pyproject.toml, as the doc says ("add each line
    marked new to the list already there"), editing the text in place."""
    text = pyproject.read_text()
    for item in snippet["project"]["dependencies"]:
        text = re.sub(r"(?m)^(dependencies = \[.*)\]$", lambda m: f'{m.group(1)}, "{item}"]', text, count=1)
    for name, spec in snippet["tool"]["uv"]["sources"].items():
        assert spec == {"workspace": True}
        text = text.replace("[tool.uv.sources]\n", f"[tool.uv.sources]\n{name} = {{ workspace = true }}\n", 1)
    for item in snippet["tool"]["ruff"]["lint"]["isort"]["known-first-party"]:
        text = re.sub(r"(?m)^(known-first-party = \[.*)\]$", lambda m: f'{m.group(1)}, "{item}"]', text, count=1)
    pyproject.write_text(text)


def test_a_member_made_by_the_doc_is_listed_by_kvbench(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    copy_metadata(ws)

    # 2b: the package, from the doc's blocks
    project = block("toml", 'name = "kv-keynorm"')
    registry = block("python", "# packages/kv-keynorm/src/kv_keynorm/registry.py")
    meta = tomllib.loads(project)
    assert meta["project"]["name"] == MEMBER
    assert meta["project"]["entry-points"]["kvcompress.methods"] == {"keynorm": f"{MODULE}.registry:METHODS"}
    pkg = ws / "packages" / MEMBER
    (pkg / "src" / MODULE).mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(project)
    (pkg / "src" / MODULE / "__init__.py").write_text("")
    (pkg / "src" / MODULE / "registry.py").write_text(registry)

    # the member alone is locked (the members glob) but not a dependency of the root: uv sync would not install it
    uv = UV
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    lock = subprocess.run([uv, "lock", "--offline"], cwd=ws, capture_output=True, text=True, timeout=120, env=env)
    assert lock.returncode == 0, lock.stderr
    assert MEMBER in locked(ws / "uv.lock") and MEMBER not in root_dependencies(ws / "uv.lock")

    # the root's three lists, from the doc's snippet
    apply_root_snippet(ws / "pyproject.toml", tomllib.loads(block("toml", "workspace root's pyproject.toml")))
    root = tomllib.loads((ws / "pyproject.toml").read_text())
    assert MEMBER in root["project"]["dependencies"] and MEMBER in root["tool"]["uv"]["sources"]
    assert MODULE in root["tool"]["ruff"]["lint"]["isort"]["known-first-party"]
    lock = subprocess.run([uv, "lock", "--offline"], cwd=ws, capture_output=True, text=True, timeout=120, env=env)
    assert lock.returncode == 0, lock.stderr
    assert MEMBER in root_dependencies(ws / "uv.lock")

    # install what uv sync installs (the member's wheel) into a folder of its own, then ask kvbench
    site = tmp_path / "site"
    install = [uv, "pip", "install", "--offline", "--no-deps", "--python", sys.executable, "--target", str(site)]
    done = subprocess.run([*install, str(pkg)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    kvbench = Path(sys.executable).with_name("kvbench")
    assert kvbench.exists(), f"{kvbench}: kvbench's console script is not installed next to the interpreter"
    env_list = dict(env, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    listed = subprocess.run([str(kvbench), "--list"], capture_output=True, text=True, timeout=300, env=env_list)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines() if line.strip()}
    assert "keynorm" in rows, listed.stdout
    assert "keep low-norm keys" in rows["keynorm"] and "ratio,tokens" in rows["keynorm"], rows["keynorm"]
    assert "snapkv" in rows  # the installed members are still listed beside it


def test_the_method_is_not_installed_here() -> None:
    """The test above listed ``keynorm`` because it installed the toy member, not because this environment has it."""
    from kvcore import registry

    assert "keynorm" not in registry.discover()


def locked(lock: Path) -> set[str]:
    """Names of the packages in ``uv.lock``."""
    return {package["name"] for package in tomllib.loads(lock.read_text())["package"]}


def root_dependencies(lock: Path) -> set[str]:
    """Names the workspace root (``kvcompress-workspace``) depends on in ``uv.lock``."""
    for package in tomllib.loads(lock.read_text())["package"]:
        if package["name"] == "kvcompress-workspace":
            return {d["name"] for d in package.get("dependencies", [])}
    raise AssertionError("uv.lock has no kvcompress-workspace package")
