"""Resumable results: one JSON file per finished cell in the output folder; a rerun skips the cells it finds.

A cell is one (method, budget, protocol) on the task samples, or one (method, budget) on the continuation
windows. Its file name is a hash of everything that decides its result: the cell itself (including a fingerprint
of the source code that computes it, :func:`code_fingerprint`) and the run's *context* (model, dtype, device, seed
and a fingerprint of the exact samples and windows), so changing any of them recomputes instead of reusing a stale
result; the stale file stays where it is. Files are written atomically (temporary file, then rename): an
interrupted run leaves either a finished cell or none.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["CellCache", "code_fingerprint"]


@functools.cache
def _source_digest(name: str) -> str:
    """sha256 of the Python sources of module or package ``name`` (every ``.py`` file under a package, by relative
    path and content); ``"absent"`` when it is not importable."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return "absent"
    h = hashlib.sha256()
    if spec.submodule_search_locations:
        for root in sorted(spec.submodule_search_locations):
            base = Path(root)
            for path in sorted(base.rglob("*.py")):
                h.update(str(path.relative_to(base)).encode() + b"\0" + path.read_bytes() + b"\0")
    elif spec.origin and spec.origin.endswith(".py"):
        h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()


def code_fingerprint(modules: Iterable[str]) -> str:
    """A short hash of the source code of ``modules`` (module or package names, e.g. ``"kv_hqekv"``,
    ``"kvbench.run"``): what a cell's result depends on besides its inputs. Computed once per process and name.

    Editing any of those files (or installing another version) changes the fingerprint, so a cell computed by other
    code is not reused. Compiled extensions and non-Python files are not covered."""
    h = hashlib.sha256()
    for name in sorted(set(modules)):
        h.update(f"{name}={_source_digest(name)}\n".encode())
    return h.hexdigest()[:16]


class CellCache:
    """Finished cells under ``folder`` for one run context.

    Parameters
    ----------
    folder : Path
        Where cell files live (created on first write).
    context : dict
        JSON-serialisable description of what every cell of this run depends on.
    """

    def __init__(self, folder: Path, context: dict[str, Any]) -> None:
        self.folder = Path(folder)
        self._context = json.dumps(context, sort_keys=True, default=str)

    def _path(self, cell: dict[str, Any]) -> Path:
        key = json.dumps(cell, sort_keys=True, default=str)
        digest = hashlib.sha256(f"{self._context}\n{key}".encode()).hexdigest()[:24]
        return self.folder / f"{digest}.json"

    def get(self, cell: dict[str, Any]) -> dict[str, Any] | None:
        """The stored result of ``cell``, or ``None`` when it has not finished (an unreadable file counts as none)."""
        path = self._path(cell)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data.get("result") if data.get("cell") == json.loads(json.dumps(cell, default=str)) else None

    def put(self, cell: dict[str, Any], result: dict[str, Any]) -> None:
        """Store ``result`` for ``cell`` atomically."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(cell)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"cell": cell, "result": result}, default=str))
        os.replace(tmp, path)

    def discard(self, cell: dict[str, Any]) -> None:
        """Forget ``cell`` (no error when it was never stored)."""
        self._path(cell).unlink(missing_ok=True)
