"""One kernel dispatch point: ``kvcore.dispatch.use_triton`` is the only definition of the "Triton or the PyTorch
reference" decision, every package's dispatch binds it (no copied logic), and ``benchmarks/decode_census.py``'s
``DISPATCH`` lists every module that calls its binding (so forcing the Triton path reaches every call site)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import kvcodec.kernels
import kvcodec.kernels.dispatch
import kvcore.dispatch

ROOT = Path(__file__).resolve().parents[1]
DECIDERS = ("use_triton", "_use_triton", "triton_available")


def sources() -> dict[str, ast.Module]:
    """``{module name: parsed source}`` of every package under core/, packages/, integrations/ and tools/."""
    out = {}
    for src in sorted(ROOT.glob("*/*/src")):
        if src.parts[-3] not in ("core", "packages", "integrations", "tools"):
            continue
        for path in src.rglob("*.py"):
            parts = path.relative_to(src).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = ast.parse(path.read_text(encoding="utf-8"))
    return out


def census_dispatch() -> set[str]:
    tree = ast.parse((ROOT / "benchmarks" / "decode_census.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DISPATCH" for t in node.targets):
            pairs = ast.literal_eval(node.value)
            assert all(name == "use_triton" for _, name in pairs), pairs
            return {module for module, _ in pairs}
    raise AssertionError("benchmarks/decode_census.py has no DISPATCH")


def test_the_decision_is_defined_once():
    defined = sorted(
        (module, node.name)
        for module, tree in sources().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name in DECIDERS
    )
    assert defined == [("kvcore.dispatch", "triton_available"), ("kvcore.dispatch", "use_triton")], defined


def test_kvcodec_reexports_the_one_decision():
    assert kvcodec.kernels.dispatch.use_triton is kvcore.dispatch.use_triton is kvcodec.kernels.use_triton
    assert kvcodec.kernels.dispatch.triton_available is kvcore.dispatch.triton_available
    assert not kvcore.dispatch.use_triton(torch.zeros(1))


def test_census_lists_every_module_calling_its_binding():
    calling = {
        module
        for module, tree in sources().items()
        if any(
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "use_triton"
            for node in ast.walk(tree)
        )
    }
    listed = census_dispatch()
    assert calling <= listed, f"add to DISPATCH in benchmarks/decode_census.py: {sorted(calling - listed)}"
    present = listed & set(sources())
    assert present <= calling, f"DISPATCH lists modules that do not call use_triton: {sorted(present - calling)}"
