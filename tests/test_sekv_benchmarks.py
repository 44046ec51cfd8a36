"""The two SEKV benchmarks a lent GPU runs (``gpu_check.sh sekv``) run on the CPU with SmolLM2's shapes and random
weights: the decode benchmark's fetch modes move the same factors (the mode changes when, not what), and the
training-step benchmark reports every phase of a step."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_sekv_decode
import sekv_train_step


def _rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]


def test_decode_benchmark_fetch_modes_move_the_same_factors(capsys):
    bench_sekv_decode.main(
        ["--random-model", "--device", "cpu", "--tokens", "300", "--steps", "2", "--rounds", "1", "--budget", "0.3"]
    )
    out = capsys.readouterr().out
    rows = {r[0]: r for r in _rows(out)[1:]}
    assert set(rows) == {"DynamicCache", "SEKV fetch=sync", "SEKV fetch=thread"}, out
    assert rows["SEKV fetch=sync"][4:] == rows["SEKV fetch=thread"][4:], out  # spans expanded, bytes moved
    assert all(float(r[1]) > 0 for r in rows.values()), out


def test_decode_benchmark_refuses_an_unknown_mode():
    import pytest

    with pytest.raises(SystemExit, match="unknown fetch mode"):
        bench_sekv_decode.main(["--random-model", "--device", "cpu", "--modes", "sync,teleport"])


def test_training_step_benchmark_reports_every_phase(capsys):
    sekv_train_step.main(["--random-model", "--device", "cpu", "--steps", "1", "--seq-len", "256", "--threads", "1"])
    out = capsys.readouterr().out
    phases = {r[0] for r in _rows(out)[1:]}
    assert phases == {"teacher pass", "surprisal + segmentation", "span preparation", "student pass + KL",
                      "backward", "AdamW"}, out  # fmt: skip
    assert "# losses of the counted steps: " in out
