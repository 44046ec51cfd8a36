"""The fused decode-attention kernels, HqeKV's window-importance kernels and HubKV's refinement kernels compile for
sm_90 (H100 / H200) at serving shapes without register spills.

No GPU is needed: ``benchmarks/sm90_resources.py`` compiles each kernel for ``cuda:90`` with the installed Triton
(specialised as on a GPU) and reads its registers and stack from the binary. A kernel that spills runs far below
the memory bandwidth (an H200 measured ~1 % with a spilling formulation,
docs/results/2026-11-26-gpu-h200.md#gpu-h200), so a spill is a regression even where every numerical test still
passes.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # Linux wheels carry the compiler and cuobjdump

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {
    "_quantized_attention_kernel",
    "_merge_splits_kernel",
    "_tiered_attention_kernel",
    "_part_attention",
    "_uniform_attention",
    "_kivi_decode_attention_kernel",
    "_biased_attention_kernel",
    "_routing_kernel",
    "_factored_items_kernel",
    "_surprisal_kernel",
    "_coarse_entries_kernel",
    "_hubkv_stats_kernel",
    "_hubkv_mix_kernel",
    "_window_lse_kernel",
    "_window_sum_kernel",
}


def _resources(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sm90_resources.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_decode_attention_kernels_compile_for_sm90_without_spills(dtype):
    """Every decode kernel compiles for sm_90 without a register spill, on the matrix units in float16 and bfloat16
    and on the IEEE float32 path (float32 caches)."""
    args = ["--float32"] if dtype == "float32" else ["--dtype", dtype]
    run = _resources(*args, *(["--sass"] if dtype == "float16" else []))
    rows = []  # every compiled variant (a kernel may appear several times: its variants are each checked)
    for line in run.stdout.splitlines():
        m = re.match(r"(\w+)\s+(ok|FAIL)\s*(.*)", line)
        if m:
            rows.append((m.group(1), m.group(2), m.group(3)))
    assert {name for name, _, _ in rows} == KERNELS, run.stdout
    for name, status, detail in rows:
        assert status == "ok", f"{name} did not compile for sm_90: {detail}"
        resources, _, sass = detail.partition(" | ")
        fields = dict(f.split(":") for f in resources.split())
        assert int(fields["STACK"]) == 0, f"{name} spills ({detail})"
        if dtype == "float16":  # --sass: the machine code read back, each tile loop with its matrix instructions
            total = re.search(r"total (\d+) instr", sass)
            assert total and int(total.group(1)) > 100, detail
            if name in ("_quantized_attention_kernel", "_kivi_decode_attention_kernel", "_tiered_attention_kernel"):
                loops = re.findall(r"loop: (\d+) instr \((\d+) BAR, (\d+) MMA", sass)
                assert any(int(mma) > 0 and int(n) < int(total.group(1)) for n, _, mma in loops), detail


def test_kivi_decode_layout_kernel_compiles_without_spills_at_every_head_dim_and_width():
    """Head dims 64 / 128 / 256 x 2 / 4 / 8 bits at the launcher's default tiles (16 entries from D 256 on: a
    32-entry tile of 8-bit codes spilled 48 bytes there), no spill; and in the machine code every tile of quantized
    entries (the aligned, unmasked path) issues at most three quarters of the general path's instructions (0.51-0.66
    of them when written)."""
    run = _resources("--kivi-shapes", "--sass")
    rows = re.findall(r"D=(\d+)\s+bits=(\d)\s+(ok|FAIL) REG:(\d+) STACK:(\d+).*?paths (\d+)-(\d+)", run.stdout)
    assert len(rows) == 9, run.stdout
    for D, bits, status, _reg, stack, fast, general in rows:
        assert status == "ok" and int(stack) == 0, f"D={D} bits={bits}: {run.stdout}"
        assert int(fast) <= 0.75 * int(general), f"D={D} bits={bits}: {run.stdout}"
