"""``benchmarks/decode_census.py --host-time`` (the CPU stand-in for a host-bound GPU decode) runs and reports each
method's host time with the reference's ratio (on the CPU paths: forcing the Triton paths would patch the method
packages for the rest of the test process)."""

import re
import sys
from pathlib import Path

import pytest
import torch

if torch.cuda.is_available():  # importing the census sets TRITON_INTERPRET=1 for the whole process
    pytest.skip("the census is a CPU tool (Triton's interpreter)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import decode_census as census


def test_host_time_table_reports_every_method_against_dynamic_cache(capsys):
    rc = census.main(["--host-time", "--methods", "dynamic,full", "--layers", "1", "--tokens", "40", "--steps", "3",
                      "--rounds", "2", "--no-triton"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = dict(re.findall(r"^\| (dynamic|full) \| ([\d.]+) \|", out, flags=re.M))
    assert set(rows) == {"dynamic", "full"} and all(float(v) > 0 for v in rows.values()), out
    assert re.search(r"^\| dynamic \|.*\| 1\.00x \|$", out, flags=re.M), out
