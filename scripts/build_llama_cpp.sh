#!/usr/bin/env bash
# Builds llama.cpp's `llama-batched-bench` (the peer of `python -m bench sweep --llama-cpp`) and
# `llama-quantize` (the presets the benchmark compares on) from the sources
# vendored in the pinned llama-cpp-python sdist, into .cache/llama.cpp/ (ignored by git).
# CPU only: Release, -march=native (GGML_NATIVE), no CUDA, no curl/OpenSSL, static libraries.
# Idempotent: does nothing when the binary exists. Prints the binary's path on stdout.
# Takes 10+ minutes on 2 cores; time-sensitive machines: `flock /tmp/forklm_bench.lock scripts/build_llama_cpp.sh`.
#
#   LLAMA_CPP_PYTHON_VERSION  the sdist to build from (default 0.3.36)
#   FORKLM_LLAMA_CPP_DIR      where to build (default .cache/llama.cpp under the repo)
#   JOBS                      parallel compile jobs (default: the number of CPUs)
#   LLAMA_CPP_ISA             native (default: -march=native) or avx2 (AVX2 + FMA + F16C + BMI2 only,
#                             into build-$VERSION-avx2: llama.cpp's AVX2 code on an AVX-512 CPU, to set
#                             beside forklm's AVX2 build, FORKLM_BLOCK_KERNEL_VNNI=0) or noamx (the native
#                             build's AVX-512 / VNNI / BF16 code without its AMX backend, into
#                             build-$VERSION-noamx: on CPUs with AMX the native build segfaults in
#                             ggml_backend_amx_mul_mat on every file, reported to llama.cpp in March 2026, still open)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
ROOT=${FORKLM_LLAMA_CPP_DIR:-$PWD/.cache/llama.cpp}
PY=${PYTHON:-$PWD/.venv/bin/python}
[ -x "$PY" ] || PY=python3
SRC="$ROOT/llama_cpp_python-$VERSION"
ISA=${LLAMA_CPP_ISA:-native}
case "$ISA" in
    native) BUILD="$ROOT/build-$VERSION"; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) BUILD="$ROOT/build-$VERSION-avx2"
          ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                     -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
    noamx) BUILD="$ROOT/build-$VERSION-noamx"
           ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                      -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON
                      -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "LLAMA_CPP_ISA must be native, avx2 or noamx, not $ISA" >&2; exit 2 ;;
esac
BIN="$BUILD/bin/llama-batched-bench"

TARGETS="llama-batched-bench llama-quantize llama-perplexity llama-tokenize"
built=1
for t in $TARGETS; do [ -x "$BUILD/bin/$t" ] || built=0; done
if [ "$built" = 1 ]; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$ROOT"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    echo "downloading the llama-cpp-python $VERSION sdist" >&2
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT" >&2
    tar -xzf "$ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$ROOT"
fi

# The sdist carries no git history; its CHANGELOG names the llama.cpp commit of this release.
COMMIT=$(awk -v v="## [$VERSION]" '$0 == v {s = 1; next} s && /^## \[/ {exit}
    s && match($0, /llama\.cpp@[0-9a-f]+/) {print substr($0, RSTART + 10, RLENGTH - 10); exit}' "$SRC/CHANGELOG.md")

# llama.cpp's CMake asks git for its commit; the sources sit inside forklm's work tree, so stop git
# from finding forklm's repository (its commit would be recorded as llama.cpp's).
export GIT_CEILING_DIRECTORIES="$ROOT"
echo "configuring llama.cpp ${COMMIT:-unknown} in $BUILD" >&2
nice cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    "${ISA_FLAGS[@]}" \
    -DGGML_CUDA=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON \
    ${COMMIT:+-DLLAMA_BUILD_COMMIT="$COMMIT"} >&2
echo "building $TARGETS (10+ minutes on 2 cores the first time)" >&2
nice cmake --build "$BUILD" --target $TARGETS -j "${JOBS:-$(nproc)}" >&2
echo "$BIN"
