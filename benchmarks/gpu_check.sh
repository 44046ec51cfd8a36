#!/usr/bin/env bash
# One device-machine session: environment, Triton kernels vs references on the GPU, then the kernel benchmarks.
# Runs from a checkout with the members' src folders on PYTHONPATH (no install needed). Logs go to $OUT (or ./gpu_out).
#
#   bash benchmarks/gpu_check.sh                       # every step
#   bash benchmarks/gpu_check.sh tests,attend,hubkv    # some steps: v2 attend hubkv tests hex hqekv smoke hf sekv sweep quant
#   bash benchmarks/gpu_check.sh v2                    # issue 43 first: decode attention v2 checked, then timed
#   bash benchmarks/gpu_check.sh v2tiers               # decode attention v2 over HqeKV's mixed tiers: checked, timed
#   bash benchmarks/gpu_check.sh hextiers              # decode attention v2 over HEX's uniform segments: tests compiled
#   bash benchmarks/gpu_check.sh v2paged               # only the paged (block-table) variant: checked, then timed,
#                                                      # then kv_vllm's packed backend decoding through it
#
# Each step runs under its own time limit, so one slow or failing step leaves the others' logs.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
source benchmarks/device_env.sh  # the members on PYTHONPATH, their entry points registered
steps=",${1:-v2,tests,attend,sweep,hubkv,hqekv,hex,smoke,hf,sekv,quant},"
has() { [[ $steps == *",$1,"* ]]; }
step() {  # step NAME SECONDS CMD...: run CMD with a time limit, log to $OUT/NAME.txt, print its tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc, $((SECONDS - t0)) s"
  tail -n "${TAIL:-25}" "$OUT/$name.txt"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.txt"
# issue 43 goal 1: decode attention v2 (folded formulation, inline-PTX code conversion) -- its tests compiled on the
# GPU (the asm path the interpreter cannot run: conversion exact, tolerance contract), then the goal's timing grid
# (fp16 SDPA, the v1 decode-layout kernel, v2; B 1 and 8, T 16k-64k, 2 and 4 bits)
has v2 && TAIL=12 step decode_v2_tests 150 python3 -m pytest -p no:cacheprovider -q --tb=short -m "not hypothesis" \
    core/kvcodec/tests/test_decode_v2.py packages/kv-baselines/tests/quant/test_kivi_decode_v2.py
has v2 && TAIL=16 step bench_decode_v2 ${V2_LIMIT:-300} python3 benchmarks/bench_decode_v2.py
# the paged variant (vLLM's block pool + block table): its tests compiled on the GPU, then paged vs contiguous v2 vs
# fp16 SDPA over the same tokens (B 1 and 8, T 16k-64k, 4 then 2 bits; contract ratios at B 1)
if has v2 || has v2paged; then
  TAIL=12 step decode_v2_paged_tests 120 python3 -m pytest -p no:cacheprovider -q --tb=short -m "not hypothesis" \
      core/kvcodec/tests/test_decode_v2_paged.py
  TAIL=16 step bench_decode_v2_paged ${V2P_LIMIT:-240} python3 benchmarks/bench_decode_v2_paged.py
  # kv_vllm's packed backend on the kernel (issue 42 goal 7): its decode tests compiled (the kernel on the backend's
  # own pool view), then one layer's decode step end to end on its pool (host reads, open blocks stacked, pool viewed
  # in place, kernel, output copy) against the kernel alone, the previous dequantize path and SDPA
  TAIL=8 step vllm_packed_decode_tests 90 python3 -m pytest -p no:cacheprovider -q --tb=short \
      integrations/kv-vllm/tests/test_vllm_packed_decode_v2.py
  TAIL=16 step bench_vllm_packed_decode ${VPD_LIMIT:-180} python3 benchmarks/bench_vllm_packed_decode.py
fi
# decode attention v2 over HqeKV's mixed tiers (kv_hqekv.kernels.triton_folded): its tests compiled on the GPU (the
# asm path, the contract), then folded vs HqeKV's blocked kernel vs fp16 SDPA (32/8 heads, d 128, T 16k-32k, B 1 and 8)
if has v2 || has v2tiers; then
  TAIL=8 step decode_v2_tiers_tests 150 python3 -m pytest -p no:cacheprovider -q --tb=short -m "not hypothesis" \
      packages/kv-hqekv/tests/test_decode_v2.py
  TAIL=12 step bench_decode_v2_tiers ${V2T_LIMIT:-180} python3 benchmarks/bench_decode_v2_tiers.py
fi
if has hextiers; then
  TAIL=8 step decode_v2_hex_tests 200 python3 -m pytest -p no:cacheprovider -q --tb=short -m "not hypothesis" \
      packages/kv-hex/tests/test_decode_v2.py
fi
has attend && step bench_fused_attend 90 python3 benchmarks/bench_fused_attend.py
has hubkv && step bench_hubkv 60 python3 benchmarks/bench_hubkv.py --min-run-time 0.1
if has tests; then
  # the kernel tests place their inputs on the GPU when one is present (compiled kernels, not the interpreter)
  # (Hypothesis-driven tests are left to the CPU run: every drawn shape compiles another variant)
  # (the workspace conftest gives each xdist worker cores // 14 torch threads: 14 workers with 16 threads each
  # slowed the CPU-bound KIVI conformance tests past the step's limit)
  TAIL=30 step kernel_tests ${TESTS_LIMIT:-200} python3 -m pytest -p no:cacheprovider -n 14 --timeout 120 -rfE -m "not hypothesis" \
      -v --tb=short \
      core/kvcodec/tests/test_kernels.py core/kvcodec/tests/test_attention.py core/kvcodec/tests/test_attention_triton.py \
      packages/kv-hubkv/tests/test_hubkv_triton.py packages/kv-baselines/tests/quant \
      packages/kv-hqekv/tests/test_kernels.py packages/kv-hex/tests/test_kernels.py packages/kv-sekv/tests/test_kernels.py \
      packages/kv-sekv/tests/test_routing_kernel.py packages/kv-sekv/tests/test_surprisal_kernel.py \
      packages/kv-sekv/tests/test_summaries_kernel.py packages/kv-sekv/tests/test_store.py::test_stream_fetch_gives_the_same_result \
      packages/kv-sekv/tests/test_store.py::test_two_stage_on_the_triton_path_equals_one_softmax \
      tools/kv-lab/tests/test_sekv_cli.py::test_training_on_cuda_from_host_sequences_resumes_on_the_cpu
fi
# end to end through the HF adapter: one process per method, so a failing method leaves the others' rates
# (64-step rounds: HqeKV re-plans every 32 decoded tokens, so each round times two re-plans at their rate)
has hf && TAIL=60 step hf_decode 300 bash -c 'for m in full kivi-2 hqekv-2 hex-3 sekv; do echo "## $m";
    timeout 58 python3 benchmarks/bench_hf_decode.py --random-model --tokens 4000 --steps 64 --rounds 3 --methods $m \
    2>&1 | grep -v "^|---" | tail -4; done'
# SEKV (issue 15): decode step time with and without the fetch overlap (sync / copy stream / worker thread), then
# router training steps on the GPU (SmolLM2's shapes, random weights: the weights cannot travel to the device)
has sekv && TAIL=12 step sekv_decode 120 python3 benchmarks/bench_sekv_decode.py --random-model --tokens 4000 \
    --steps 32 --rounds 3
has sekv && TAIL=14 step sekv_train 90 python3 benchmarks/sekv_train_step.py --device cuda --random-model \
    --steps 6 --seq-len 1024
has sweep && TAIL=8 step bench_fused_sweep 60 python3 benchmarks/bench_fused_attend.py --sweep --lengths 16384 --batch 1 --bits 2
has hqekv && step bench_hqekv 60 python3 benchmarks/bench_hqekv.py --lengths 4096,16384,65536
has hex && step bench_hex 60 python3 benchmarks/bench_hex.py --tables attend --attend-lengths 3840,16384
# every registered method through kvbench's evaluation loop on the device (SmolLM2's shapes, random weights, bf16)
has smoke && TAIL=40 step kvbench_smoke ${SMOKE_LIMIT:-120} python3 benchmarks/kvbench_device_smoke.py --device cuda \
    --tokens 2000 --methods ${SMOKE_METHODS:-snapkv,hubkv,kivi-2,hqekv-2,hex-3,sekv}
has quant && step bench_quant 150 python3 benchmarks/bench_quant.py
exit 0
