"""Check that every workspace member's wheel installs alone into a clean virtual environment and imports.

For each member this script builds the wheel (``uv build --package <name> --wheel``), creates a fresh venv
(``uv venv``), installs that wheel plus only the wheels of the workspace members it depends on (``kvcore``,
``kvcodec`` ...; everything else comes from the package index), then, from a folder outside the checkout and
without ``PYTHONPATH``:

* imports the member's module and fails on torch's "Failed to initialize NumPy" warning (an undeclared numpy);
* loads every ``kvcompress.methods`` entry point the member declares, builds each method it registers at its
  default budget and compresses random keys and values of SmolLM2-135M's layer shape with it (queries where the
  scorer needs them, a random surprisal for SEKV; a method needing another model-made extra, such as KVzip's,
  is built but not run), checking that the store reads back every kept entry's shape and counts its bytes;
* runs ``<script> --help`` for every console script it declares.

Extras that name other workspace members (``kv-hubkv[baselines]``) get a row of their own, installed with those
members' wheels. The default run checks every workspace member (found from the root ``pyproject.toml``'s globs) but the
engine adapters, each after the members it depends on.

Usage::

    uv run python benchmarks/check_wheels.py                 # every member
    uv run python benchmarks/check_wheels.py kvcore kv-hubkv # some of them
    uv run python benchmarks/check_wheels.py --keep DIR      # keep the wheels and venvs in DIR

Versions of index packages are pinned to ``uv.lock`` (``uv export`` as constraints), so the check installs from
uv's cache when the workspace has been synced. Takes minutes (a torch install per venv): not part of the test
suite. Exits 1 if any present member fails.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGINE_ADAPTERS = frozenset({"kv-vllm", "kv-sglang"})
"""Members checked only when named: their tests run inside their engines' own environments (vLLM, SGLang)."""

ENTRY_POINT_GROUP = "kvcompress.methods"
NUMPY_WARNING = "Failed to initialize NumPy"


@dataclass
class Member:
    """One workspace member as declared in its ``pyproject.toml``."""

    name: str
    path: Path
    dependencies: list[str]
    extras: dict[str, list[str]]
    scripts: list[str]
    entry_points: list[str]

    @property
    def module(self) -> str:
        return self.name.replace("-", "_")


@dataclass
class Row:
    """One line of the report."""

    target: str
    status: str = "ok"
    seconds: float = 0.0
    wheels: list[str] = field(default_factory=list)
    detail: str = ""


def requirement_name(req: str) -> str:
    """``"kv-baselines>=0.1; extra == 'x'"`` -> ``"kv-baselines"`` (normalised)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if match is None:
        raise ValueError(f"cannot read a project name from the requirement {req!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def find_members(root: Path) -> dict[str, Member]:
    """Workspace members of ``root`` by project name (from ``[tool.uv.workspace].members`` globs)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    globs = config["tool"]["uv"]["workspace"]["members"]
    found: dict[str, Member] = {}
    for pattern in globs:
        for path in sorted(root.glob(pattern)):
            toml = path / "pyproject.toml"
            if not toml.is_file():
                continue
            project = tomllib.loads(toml.read_text())["project"]
            entry_points = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
            member = Member(
                name=requirement_name(project["name"]),
                path=path,
                dependencies=list(project.get("dependencies", [])),
                extras={k: list(v) for k, v in project.get("optional-dependencies", {}).items()},
                scripts=sorted(project.get("scripts", {})),
                entry_points=sorted(entry_points),
            )
            found[member.name] = member
    return found


def dependency_order(members: dict[str, Member]) -> list[str]:
    """Every member but the engine adapters, each after the workspace members it depends on (the default run)."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for dep in map(requirement_name, members[name].dependencies):
            if dep in members and dep != name:
                visit(dep)
        order.append(name)

    for name in sorted(members):
        if name not in ENGINE_ADAPTERS:
            visit(name)
    return order


def workspace_closure(names: list[str], members: dict[str, Member]) -> list[str]:
    """``names`` and the workspace members they depend on, transitively (not through extras)."""
    seen: list[str] = []
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        todo.extend(d for d in map(requirement_name, members[name].dependencies) if d in members)
    return seen


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 900) -> tuple[int, str]:
    """Run ``cmd``; return its exit status and combined output."""
    res = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def clean_env() -> dict[str, str]:
    """The environment for commands inside a venv: no ``PYTHONPATH``, no active venv of the caller."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.pop("TRITON_INTERPRET", None)
    return env


def build_wheel(uv: str, member: Member, out: Path) -> Path:
    """``uv build --package <name> --wheel``; returns the wheel's path."""
    before = set(out.glob("*.whl"))
    code, log = run([uv, "build", "--package", member.name, "--wheel", "--out-dir", str(out)], cwd=ROOT)
    if code != 0:
        raise RuntimeError(f"uv build failed:\n{log[-3000:]}")
    new = sorted(set(out.glob("*.whl")) - before)
    prefix = member.module + "-"
    wheels = new or sorted(out.glob(prefix + "*.whl"))
    wheels = [w for w in wheels if w.name.startswith(prefix)]
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel named {prefix}*.whl in {out}, found {[w.name for w in wheels]}")
    return wheels[0]


def check_script(member: Member, extra_modules: list[str]) -> str:
    """The Python program run inside the venv: imports, numpy warning, entry points."""
    modules = [member.module, *extra_modules]
    return f"""
import importlib, io, sys, warnings
from contextlib import redirect_stderr
from importlib.metadata import distribution
buf = io.StringIO()
with warnings.catch_warnings(record=True) as caught, redirect_stderr(buf):
    warnings.simplefilter("always")
    for name in {modules!r}:
        importlib.import_module(name)
text = buf.getvalue() + "\\n".join(str(w.message) for w in caught)
if {NUMPY_WARNING!r} in text:
    sys.exit("importing printed torch's numpy warning (numpy is not declared): " + text[-500:])
eps = distribution({member.name!r}).entry_points
tables = [(ep.name, ep.load()) for ep in eps if ep.group == {ENTRY_POINT_GROUP!r}]
if tables:  # build every registered method and compress random tensors of SmolLM2-135M's layer shape with it
    import torch
    from kvcore import ScoringContext
    from kvcore.registry import collect
    g = torch.Generator().manual_seed(0)
    B, H, HQ, T, D = 1, 3, 9, 512, 64
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    q = torch.randn(B, HQ, 32, D, generator=g)
    ran, built, elsewhere = [], [], []
    for name, method in collect(tables).items():
        try:
            comp = method.build()
        except LookupError:  # composes a method of a package this venv lacks (kv-hubkv without its baselines extra)
            elsewhere.append(name)
            continue
        # extras an adapter computes without a forward pass, synthesized; a model-made one (KVzip's) is named
        supply = {{
            "surprisal": lambda: torch.rand(B, T, generator=g) * 8,
            "rope_inv_freq": lambda: 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D),
            "sentence_ids": lambda: torch.randint(0, 2, (B, T), generator=g).cumsum(-1),
        }}
        if set(comp.scorer.needs_extras) - set(supply):
            built.append(name)
            continue
        extras = {{x: supply[x]() for x in comp.scorer.needs_extras}}
        ctx = ScoringContext(k, v, q if comp.scorer.needs_queries else None, layer_idx=0, extras=extras)
        (store,) = comp.compress_layers([ctx])  # one layer: a "global" budget (PyramidKV) needs the layer list
        view = store.read()
        if view.keys.shape[:2] != (B, H) or view.keys.shape[-1] != D or not store.nbytes() > 0:
            sys.exit(f"method {{name}}: read {{tuple(view.keys.shape)}}, nbytes {{store.nbytes()}}")
        ran.append(name)
    print("compressed:", " ".join(ran) or "-", "(built only:", " ".join(built) or "-",
          "/ need another package:", (" ".join(elsewhere) or "-") + ")")
print("ok")
"""


def check(
    uv: str,
    target: str,
    member: Member,
    wheels: list[Path],
    work: Path,
    constraints: Path | None,
    extra_modules: list[str],
    extra: str | None,
) -> Row:
    """Install ``wheels`` into a fresh venv under ``work`` and run the import / entry-point / script checks."""
    row = Row(target=target, wheels=[w.name.split("-")[0] for w in wheels[1:]])
    start = time.perf_counter()
    venv = work / f"venv-{target.replace('[', '_').replace(']', '')}"
    if venv.exists():
        shutil.rmtree(venv)
    code, log = run([uv, "venv", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", str(venv)], cwd=work)
    if code != 0:
        return _fail(row, start, "venv", log)
    python = venv / "bin" / "python"
    first = f"{wheels[0]}[{extra}]" if extra else str(wheels[0])
    cmd = [uv, "pip", "install", "--python", str(python), first, *map(str, wheels[1:])]
    if constraints is not None:
        cmd += ["--constraints", str(constraints)]
    code, log = run(cmd, cwd=work, env=clean_env())
    if code != 0:
        return _fail(row, start, "install", log)
    code, log = run([str(python), "-c", check_script(member, extra_modules)], cwd=work, env=clean_env())
    if code != 0 or not log.strip().endswith("ok"):
        return _fail(row, start, "import", log)
    compressed = [line for line in log.splitlines() if line.startswith("compressed:")]
    for script in member.scripts:
        code, log = run([str(venv / "bin" / script), "--help"], cwd=work, env=clean_env())
        if code != 0:
            return _fail(row, start, f"{script} --help", log)
    row.seconds = time.perf_counter() - start
    notes = [f"imports {', '.join([member.module, *extra_modules])}"]
    if member.entry_points:
        notes.append(f"entry points {', '.join(member.entry_points)} load")
        notes.extend(compressed[-1:])
    if member.scripts:
        notes.append(f"{', '.join(member.scripts)} --help runs")
    row.detail = "; ".join(notes)
    return row


def _fail(row: Row, start: float, step: str, log: str) -> Row:
    row.status = "FAILED"
    row.seconds = time.perf_counter() - start
    row.detail = f"{step}: " + " | ".join(line.strip() for line in log.strip().splitlines()[-4:])
    return row


def export_constraints(uv: str, out: Path) -> Path | None:
    """Index-package pins from ``uv.lock`` (no workspace members, no hashes), or ``None`` if export fails."""
    path = out / "constraints.txt"
    cmd = [
        uv,
        "export",
        "--frozen",
        "--all-packages",
        "--all-extras",
        "--all-groups",
        "--no-emit-workspace",
        "--no-hashes",
        "--no-header",
        "--no-annotate",
        "-o",
        str(path),
    ]
    code, log = run(cmd, cwd=ROOT)
    if code != 0:
        print(f"warning: uv export failed, installing unpinned:\n{log[-1000:]}", file=sys.stderr)
        return None
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "members", nargs="*", help="members to check (default: every workspace member but the engine adapters)"
    )
    parser.add_argument("--keep", type=Path, help="build into this folder and keep it (default: a temporary one)")
    parser.add_argument("--no-extras", action="store_true", help="skip the rows of workspace-member extras")
    args = parser.parse_args(argv)

    uv = shutil.which("uv")
    if uv is None:
        print("uv is not on PATH (pip install uv)", file=sys.stderr)
        return 2
    members = find_members(ROOT)
    wanted = [requirement_name(m) for m in args.members] or dependency_order(members)
    unknown = [m for m in wanted if m not in members]
    if unknown:
        print(f"unknown members {unknown}; known: {sorted(members)}", file=sys.stderr)
        return 2

    work = args.keep or Path(tempfile.mkdtemp(prefix="kvcompress-wheels-"))
    work.mkdir(parents=True, exist_ok=True)
    dist = work / "dist"
    dist.mkdir(exist_ok=True)
    constraints = export_constraints(uv, work)
    rows: list[Row] = []
    built: dict[str, Path] = {}

    def wheel(name: str) -> Path:
        if name not in built:
            built[name] = build_wheel(uv, members[name], dist)
        return built[name]

    total = time.perf_counter()
    try:
        for name in wanted:
            if name not in members:
                rows.append(Row(target=name, status="missing", detail="no such member in this checkout"))
                continue
            member = members[name]
            start = time.perf_counter()
            try:
                own = wheel(name)
                deps = [wheel(d) for d in workspace_closure([name], members) if d != name]
            except RuntimeError as e:
                rows.append(_fail(Row(target=name), start, "build", str(e)))
                continue
            build_s = time.perf_counter() - start
            row = check(uv, name, member, [own, *deps], work, constraints, [], None)
            row.seconds += build_s
            rows.append(row)
            print(f"{row.target}: {row.status} ({row.seconds:.0f} s)", file=sys.stderr, flush=True)
            if args.no_extras:
                continue
            for extra, reqs in sorted(member.extras.items()):
                ws = [requirement_name(r) for r in reqs if requirement_name(r) in members]
                if not ws:
                    continue
                target = f"{name}[{extra}]"
                start = time.perf_counter()
                try:
                    closure = [d for d in workspace_closure([name, *ws], members) if d != name]
                    extra_wheels = [wheel(d) for d in closure]
                except RuntimeError as e:
                    rows.append(_fail(Row(target=target), start, "build", str(e)))
                    continue
                build_s = time.perf_counter() - start
                modules = [members[d].module for d in ws]
                row = check(uv, target, member, [own, *extra_wheels], work, constraints, modules, extra)
                row.seconds += build_s
                rows.append(row)
                print(f"{row.target}: {row.status} ({row.seconds:.0f} s)", file=sys.stderr, flush=True)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)

    print(
        f"\nwheel check: python {sys.version.split()[0]}, uv {_uv_version(uv)}, "
        f"{time.perf_counter() - total:.0f} s in all\n"
    )
    print("| member | status | s | with workspace wheels | checked |")
    print("|---|---|---|---|---|")
    for row in rows:
        with_ = ", ".join(row.wheels) or "-"
        seconds = f"{row.seconds:.0f}" if row.status != "missing" else "-"
        print(f"| {row.target} | {row.status} | {seconds} | {with_} | {row.detail} |")
    return 1 if any(r.status == "FAILED" for r in rows) else 0


def _uv_version(uv: str) -> str:
    code, out = run([uv, "--version"], cwd=ROOT)
    return out.split()[1] if code == 0 and len(out.split()) > 1 else "?"


if __name__ == "__main__":
    sys.exit(main())
