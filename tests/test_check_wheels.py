"""``benchmarks/check_wheels.py``'s in-venv program, run here in the workspace's interpreter: it builds every
method a member registers and compresses random tensors with each, naming those it can only build (a model-made
extra such as KVzip's) and those that compose a method of a package the venv lacks."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import check_wheels

from kv_baselines.registry import METHODS


def test_every_registered_method_compresses_or_is_named():
    member = check_wheels.find_members(check_wheels.ROOT)["kv-baselines"]
    run = subprocess.run([sys.executable, "-c", check_wheels.check_script(member, [])], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr[-2000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("compressed:"))
    ran = line.removeprefix("compressed:").split("(")[0].split()
    assert sorted(ran) == sorted(m.name for m in METHODS if m.name not in ("kvzip", "kvzip-uniform")), line
    assert "(built only: kvzip kvzip-uniform / need another package: -)" in line, line


def test_the_default_run_covers_every_member_after_its_dependencies():
    """Invariant: the default member list is derived from the workspace (a new member is checked without editing the
    script), holds every member but the engine adapters, and puts each after the workspace members it needs."""
    members = check_wheels.find_members(check_wheels.ROOT)
    order = check_wheels.dependency_order(members)
    assert set(order) == set(members) - check_wheels.ENGINE_ADAPTERS and len(order) == len(set(order))
    for name in order:
        for dep in map(check_wheels.requirement_name, members[name].dependencies):
            if dep in members:
                assert order.index(dep) < order.index(name), (dep, name)
