#!/usr/bin/env bash
# Builds ik_llama.cpp's `llama-batched-bench` (ikawrakow/ik_llama.cpp: llama.cpp with the iqk CPU kernels;
# `-rtr` repacks every tensor to row-interleaved layouts at load), the second peer of
# `python -m bench sweep --llama-cpp` (FORKLM_LLAMA_CPP_BIN=<this binary>: rows "ik_llama.cpp" / "-fa").
# ik_llama.cpp is not on the package registries: fetch its sources yourself (git clone
# https://github.com/ikawrakow/ik_llama.cpp) and point IK_LLAMA_CPP_SRC at them (default
# .cache/ik_llama.cpp/src). CPU only: Release, -march=native, static, no CUDA / curl; into
# .cache/ik_llama.cpp/build (ignored by git). Idempotent; prints the binary's path on stdout.
# Takes 10+ minutes on 2 cores: `flock /tmp/forklm_bench.lock scripts/build_ik_llama_cpp.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD/.cache/ik_llama.cpp
SRC=${IK_LLAMA_CPP_SRC:-$ROOT/src}
BUILD=$ROOT/build
BIN="$BUILD/bin/llama-batched-bench"
if [ -x "$BIN" ]; then
    echo "$BIN"
    exit 0
fi
if [ ! -f "$SRC/CMakeLists.txt" ]; then
    echo "no ik_llama.cpp sources at $SRC: git clone https://github.com/ikawrakow/ik_llama.cpp there, or set IK_LLAMA_CPP_SRC" >&2
    exit 1
fi
export GIT_CEILING_DIRECTORIES="$ROOT"
nice cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
nice cmake --build "$BUILD" --target llama-batched-bench -j "${JOBS:-$(nproc)}" >&2
echo "$BIN"
