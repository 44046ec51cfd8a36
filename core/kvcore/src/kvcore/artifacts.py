"""Checksummed artifacts a method ships (a trained router, a gate): a tensor file and its JSON sidecar.

The sidecar ``path.with_suffix(".json")`` records the artifact's metadata (shapes, config, the model it was trained
for, a format version) and the SHA-256 of the tensor file; loading refuses a missing file, another format version,
a checksum that does not match and, when asked, another model — before any tensor is read into a module.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = ["read_sidecar", "write_sidecar"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_sidecar(path: str | Path, meta: dict[str, Any]) -> Path:
    """Write ``meta`` plus the SHA-256 of the tensor file ``path`` to ``path.with_suffix(".json")``.

    Parameters
    ----------
    path : str or Path
        The tensor file, already written.
    meta : dict
        JSON-serializable metadata (must not hold ``"sha256"``: it is computed here).

    Returns
    -------
    Path
        The sidecar's path.
    """
    path = Path(path)
    side = path.with_suffix(".json")
    side.write_text(json.dumps(meta | {"sha256": _sha256(path)}, indent=1, sort_keys=True) + "\n")
    return side


def read_sidecar(
    path: str | Path, *, what: str, writer: str, format_version: int, model_id: str | None = None
) -> dict[str, Any]:
    """The checked metadata of the artifact ``path`` (see the module docstring).

    Parameters
    ----------
    path : str or Path
        The tensor file.
    what : str
        What the artifact is, for messages (``"SEKV router"``).
    writer : str
        What writes it, for the missing-file message (``"SEKVRouter.save"``).
    format_version : int
        The version the reader understands.
    model_id : str, optional
        When given, the model the artifact must have been trained for.

    Returns
    -------
    dict
        The sidecar's metadata.

    Raises
    ------
    FileNotFoundError
        The tensor file or its sidecar is missing.
    ValueError
        Another format version, a checksum mismatch, or another model.
    """
    path = Path(path)
    side = path.with_suffix(".json")
    for p in (path, side):
        if not p.is_file():
            raise FileNotFoundError(f"{what} artifact: {p} is missing (written by {writer})")
    meta = json.loads(side.read_text())
    if meta.get("format_version") != format_version:
        raise ValueError(f"{side}: format_version {meta.get('format_version')!r}, expected {format_version}")
    digest = _sha256(path)
    if digest != meta.get("sha256"):
        raise ValueError(f"{path}: SHA-256 {digest} does not match the one recorded in {side.name}")
    if model_id is not None and meta.get("model_id") != model_id:
        raise ValueError(f"{path} is a {what} for model {meta.get('model_id')!r}, not {model_id!r}")
    return meta
