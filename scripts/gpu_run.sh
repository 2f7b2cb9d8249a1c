#!/usr/bin/env bash
# One device call (run from the repository root on the GPU machine; results under $OUT):
# the kernel's correctness on the GPU, the kernel benchmark, then the end-to-end benchmark on a
# random-weight Llama-3-8B shape. Each step writes its JSON before the next starts.
set -uo pipefail
OUT=${OUT:-/tmp/forklm-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
timeout 150 python scripts/gpu_check.py --out "$OUT/kernel_check.json" > "$OUT/kernel_check.log" 2>&1
echo "check rc=$?"
timeout 200 python -m bench kernel --device cuda --dtype bfloat16 --out "$OUT/kernel_cuda_bfloat16.json" \
    > "$OUT/kernel_bench.md" 2> "$OUT/kernel_bench.log"
echo "kernel bench rc=$?"
timeout 200 python -m bench sweep --model random:llama3-8b --device cuda --dtype bfloat16 \
    --contexts 2048,8192 --ns 1,16,64 --new-tokens 32 --transformers-max-n 16 \
    --out "$OUT/sweep_cuda_bfloat16.json" > "$OUT/sweep.md" 2> "$OUT/sweep.log"
echo "sweep rc=$?"
tail -5 "$OUT"/*.log
