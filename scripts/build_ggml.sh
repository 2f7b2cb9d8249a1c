#!/usr/bin/env bash
# Builds ggml's CPU library (libggml-base + libggml-cpu, shared) from the llama.cpp sources vendored
# in the pinned llama-cpp-python sdist: forklm runs the GGUF types it has no kernel of its own for
# (Q4_0, Q5_0, Q5_1, the K-quants, IQ4_NL, F16, BF16) through ggml's own dot products
# (forklm/kernels/ggml_gemm.py). CPU only, -march=native, no OpenMP (forklm threads with PyTorch's
# pool). Idempotent: does nothing when the libraries exist. Prints the install prefix on stdout.
# About 3 minutes on 2 cores.
#
#   LLAMA_CPP_PYTHON_VERSION  the sdist to build from (default 0.3.36)
#   FORKLM_GGML_DIR           where to install (default .cache/ggml-$VERSION under the repo)
#   JOBS                      parallel compile jobs (default: the number of CPUs)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PREFIX=${FORKLM_GGML_DIR:-$PWD/.cache/ggml-$VERSION}
SRC_ROOT=${FORKLM_LLAMA_CPP_DIR:-$PWD/.cache/llama.cpp}
PY=${PYTHON:-$PWD/.venv/bin/python}
[ -x "$PY" ] || PY=python3
SRC="$SRC_ROOT/llama_cpp_python-$VERSION"
BUILD="$SRC_ROOT/ggml-build-$VERSION"

if [ -f "$PREFIX/lib/libggml-cpu.so" ] && [ -f "$PREFIX/include/ggml-cpu.h" ]; then
    echo "$PREFIX"
    exit 0
fi

mkdir -p "$SRC_ROOT"
if [ ! -d "$SRC/vendor/llama.cpp/ggml" ]; then
    echo "downloading the llama-cpp-python $VERSION sdist (llama.cpp's sources)" >&2
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC_ROOT" >&2
    tar -xzf "$SRC_ROOT/llama_cpp_python-$VERSION.tar.gz" -C "$SRC_ROOT"
fi
export GIT_CEILING_DIRECTORIES="$SRC_ROOT"
echo "configuring ggml in $BUILD" >&2
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON \
    -DGGML_NATIVE=ON \
    -DGGML_OPENMP=OFF \
    -DGGML_BACKEND_DL=OFF \
    -DGGML_CUDA=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_INSTALL_PREFIX="$PREFIX" >&2
echo "building ggml-base and ggml-cpu (about 3 minutes on 2 cores)" >&2
nice cmake --build "$BUILD" --target ggml-base ggml-cpu -j "${JOBS:-$(nproc)}" >&2
mkdir -p "$PREFIX/lib" "$PREFIX/include"
cp -a "$BUILD"/bin/libggml-base.so* "$BUILD"/bin/libggml-cpu.so* "$PREFIX/lib/" 2>/dev/null \
    || cp -a $(find "$BUILD" -name 'libggml-base.so*' -o -name 'libggml-cpu.so*') "$PREFIX/lib/"
cp "$SRC/vendor/llama.cpp/ggml/include/"*.h "$PREFIX/include/"
echo "$PREFIX"
