#!/usr/bin/env bash
# One device call (run from the repository root on the GPU machine; results under $OUT):
# the kernel's correctness on the GPU, the kernel benchmark, then the end-to-end benchmark on a
# random-weight Llama-3-8B shape, one context per run. Each step writes its JSON before the next
# starts, and each has its own time limit, so a slow step loses only its own result.
# Packages the GPU image lacks (gguf, llguidance) travel as wheels in .whl/ (see bench/GPU_NOTES.md).
set -uo pipefail
OUT=${OUT:-/tmp/forklm-gpu}
PY=${PY:-python3}
W=$(mktemp -d)  # every file of the run; packed into $OUT/gpu_results.tgz after each step (the device tool returns 8 files)
mkdir -p "$OUT"
pack() { tar czf "$OUT/gpu_results.tgz" -C "$W" . ; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$W/gpu.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$W/gpu.txt" 2>&1
timeout 120 $PY scripts/gpu_check.py --out "$W/kernel_check.json" > "$W/kernel_check.log" 2>&1
echo "check rc=$?"; pack
timeout 150 $PY -m bench kernel --device cuda --dtype bfloat16 --out "$W/kernel_cuda_bfloat16.json" \
    > "$W/kernel_bench.md" 2> "$W/kernel_bench.log"
echo "kernel bench rc=$?"; pack
for m_c in 2048 8192; do
    timeout 120 $PY -m bench sweep --model random:llama3-8b --device cuda --dtype bfloat16 \
        --contexts $m_c --ns 1,16,64 --new-tokens 32 --paths standard,bifurcated,auto --transformers-max-n 16 \
        --out "$W/sweep_cuda_bfloat16_$m_c.json" --plot "$W/sweep_$m_c.png" > "$W/sweep_$m_c.md" 2> "$W/sweep_$m_c.log"
    echo "sweep m_c=$m_c rc=$?"; pack
done
tail -n 4 "$W"/*.log
