#!/usr/bin/env bash
# One device-machine session: environment, Triton kernels vs references on the GPU, then the kernel benchmarks.
# Runs from a checkout with the members' src folders on PYTHONPATH (no install needed). Logs go to $OUT (or ./gpu_out).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$(ls -d core/*/src packages/*/src integrations/*/src | tr '\n' ':')${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
step=${1:-all}
if [[ $step == all || $step == tests ]]; then
  python3 -m pytest -q -p no:cacheprovider -x --timeout 300 \
      packages/kv-hubkv/tests/test_hubkv_triton.py core/kvcodec/tests/test_kernels.py \
      packages/kv-hqekv/tests/test_kernels.py packages/kv-hex/tests/test_kernels.py packages/kv-sekv/tests/test_kernels.py \
      2>&1 | tee "$OUT/kernel_tests.txt" | tail -15
  python3 -m pytest -q -p no:cacheprovider --timeout 600 core/kvcore/tests core/kvcodec/tests packages/kv-baselines/tests packages/kv-hubkv/tests \
      2>&1 | tee "$OUT/unit_tests.txt" | tail -15
fi
if [[ $step == all || $step == bench ]]; then
  python3 benchmarks/bench_hubkv.py 2>&1 | tee "$OUT/bench_hubkv.txt"
  python3 benchmarks/bench_quant.py 2>&1 | tee "$OUT/bench_quant.txt"
  python3 benchmarks/bench_hqekv.py --lengths 4096,16384,65536 2>&1 | tee "$OUT/bench_hqekv.txt"
  python3 benchmarks/bench_hex.py --tables attend 2>&1 | tee "$OUT/bench_hex.txt"
fi
