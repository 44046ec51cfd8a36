"""``benchmarks/kvbench_device_smoke.py`` -- what a lent GPU runs to check kvbench's loop there -- runs on the CPU:
its rows come from kvbench's evaluation of real stores, paired with the full cache, and a failing method fails it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kvbench_device_smoke as smoke


def test_two_methods_run_and_report_their_bytes(capsys):
    rc = smoke.main(["--device", "cpu", "--tokens", "400", "--samples", "1", "--windows", "1", "--methods",
                     "snapkv,kivi-2@0"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    table = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| ")]
    col = table[0].index("B/token")
    held = {row[0]: float(row[col]) for row in table[1:] if not row[0].startswith("-")}
    assert {"full", "snapkv", "kivi-2"} <= set(held), out
    # a quarter of the tokens kept; 2-bit codes beside KIVI's full-precision residual of 128 tokens
    assert held["snapkv"] < 0.5 * held["full"] and held["kivi-2"] < held["full"], held
    assert "0 failed" in out


def test_a_method_that_refuses_its_input_makes_it_exit_1(monkeypatch, capsys):
    import kvbench.run

    real = kvbench.run._compress

    def refusing(m, collected, forward_peak, cache):
        if m.item.name == "snapkv":  # as _compress does when a compressor raises ValueError
            kvbench.run._refuse(m, ValueError("refused for the test"), cache)
            return None
        return real(m, collected, forward_peak, cache)

    monkeypatch.setattr(kvbench.run, "_compress", refusing)
    rc = smoke.main(["--device", "cpu", "--tokens", "120", "--samples", "1", "--windows", "0", "--methods", "snapkv"])
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED snapkv" in out, out
