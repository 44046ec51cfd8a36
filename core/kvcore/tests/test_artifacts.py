"""Checksummed artifacts: the sidecar records the tensor file's SHA-256; loading refuses every mismatch."""

import json

import pytest

from kvcore.artifacts import read_sidecar, write_sidecar


def _artifact(tmp_path, meta=None):
    path = tmp_path / "gate.bin"
    path.write_bytes(b"weights")
    write_sidecar(path, {"format_version": 1, "model_id": "m", **(meta or {})})
    return path


def test_round_trip_and_checks(tmp_path):
    path = _artifact(tmp_path, {"layers": 3})
    meta = read_sidecar(path, what="test gate", writer="save", format_version=1, model_id="m")
    assert meta["layers"] == 3 and len(meta["sha256"]) == 64
    with pytest.raises(ValueError, match="is a test gate for model 'm', not 'other'"):
        read_sidecar(path, what="test gate", writer="save", format_version=1, model_id="other")
    with pytest.raises(ValueError, match="format_version 1, expected 2"):
        read_sidecar(path, what="test gate", writer="save", format_version=2)
    path.write_bytes(b"weightz")  # the tensor file changed after its sidecar was written
    with pytest.raises(ValueError, match="SHA-256 .* does not match"):
        read_sidecar(path, what="test gate", writer="save", format_version=1)


def test_missing_files_are_named(tmp_path):
    path = _artifact(tmp_path)
    path.with_suffix(".json").unlink()
    with pytest.raises(FileNotFoundError, match=r"test gate artifact: .*gate\.json is missing \(written by save\)"):
        read_sidecar(path, what="test gate", writer="save", format_version=1)


def test_the_sidecar_is_json_with_the_checksum(tmp_path):
    path = _artifact(tmp_path)
    side = json.loads(path.with_suffix(".json").read_text())
    assert set(side) == {"format_version", "model_id", "sha256"}
