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


def test_hqekv_window_kernels_compile_one_variant_whatever_the_held_length():
    """HqeKV scores its window at every re-plan over the entries then held: lengths and split counts that change
    between re-plans (one split, then two; a length divisible by 16, then not) keep one launch variant per kernel
    (the census keys launches as a GPU compile does)."""
    from kv_hqekv.kernels.triton_importance import window_importance_triton

    census.install()
    record = census.Census()
    census.CURRENT.append(record)
    try:
        g = torch.Generator().manual_seed(0)
        for n in (208, 300, 517):  # 16-divisible, then not; 1, 2, then 3 splits of 256 keys
            q, k = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
            window_importance_triton(q, k)
    finally:
        census.CURRENT.remove(record)
    assert {name: len(keys) for name, keys in record.seen.items()} == {
        "kv_hqekv._window_lse_kernel": 1,
        "kv_hqekv._window_sum_kernel": 1,
    }


def test_bad_counts_are_refused_with_a_one_line_error(capsys):
    for argv in (["--host-time", "--rounds", "0"], ["--steps", "x"]):
        with pytest.raises(SystemExit) as exit_:
            census.main(argv)
        assert exit_.value.code == 2
        assert "expected a whole number" in capsys.readouterr().err
