#!/usr/bin/env bash
# Build llama.cpp's `llama-bench` for benchmarks/decode_vs_peers.py (issue 14), without AMX.
#
# What it does: downloads the llama-cpp-python sdist (version $LCP_VERSION, default 0.3.36, whose
# vendor/llama.cpp is llama.cpp commit 0c1e570 of 2026-10-01, ggml 0.25.3), unpacks it and builds
# only the llama-bench target from vendor/llama.cpp, statically linked, with -j2.
#
# Flags: GGML_NATIVE=OFF with AVX, AVX2, BMI2, FMA, F16C, AVX512, AVX512_VBMI, AVX512_VNNI and
# AVX512_BF16 ON, and GGML_AMX_TILE / GGML_AMX_INT8 / GGML_AMX_BF16 OFF: on the project's AVX-512/AMX
# Xeon the kernel does not grant AMX tiles to the process, and a native (AMX) build dies with SIGILL.
# LLAMA_CURL=OFF and LLAMA_OPENSSL=OFF (no downloads from the binary), BUILD_SHARED_LIBS=OFF.
#
# LLAMA_ISA=avx2: the AVX2-only build instead (AVX512* OFF, as on a CPU without AVX-512; issue 43's
# comparison for `MIXSERVE_ISA=avx2`), landing as $OUT/bin/llama-bench-avx2 from $OUT/build-avx2.
#
# LLAMA_SERVER=1: llama-server too (benchmarks/structured_vs_llama.py, issue 33), landing as
# $OUT/bin/llama-server.
#
# Where it lands: $OUT/bin/llama-bench, OUT = ${XDG_CACHE_HOME:-~/.cache}/mixserve/llama.cpp (the
# default path decode_vs_peers.py looks at). Build tree: $OUT/build; source: $OUT/src.
#
#     flock /tmp/heavy.lock bash benchmarks/build_llama_cpp.sh
set -euo pipefail

LCP_VERSION=${LCP_VERSION:-0.3.36}
cache=${XDG_CACHE_HOME:-$HOME/.cache}
case "$cache" in /*) ;; *) cache=$HOME/.cache ;; esac
OUT=${OUT:-$cache/mixserve/llama.cpp}
mkdir -p "$OUT/src" "$OUT/bin"

sdist="$OUT/src/llama_cpp_python-$LCP_VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    python3 -m pip download "llama-cpp-python==$LCP_VERSION" --no-deps --no-binary :all: -d "$OUT/src"
fi
srcdir="$OUT/src/llama_cpp_python-$LCP_VERSION"
[ -d "$srcdir" ] || tar xzf "$sdist" -C "$OUT/src"
llama="$srcdir/vendor/llama.cpp"

server=OFF
[ -n "${LLAMA_SERVER:-}" ] && server=ON
if [ "${LLAMA_ISA:-}" = avx2 ]; then
    avx512=OFF; build="$OUT/build-avx2"; bin="$OUT/bin/llama-bench-avx2"
else
    avx512=ON; build="$OUT/build"; bin="$OUT/bin/llama-bench"
fi
cmake -S "$llama" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=$server \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=$avx512 -DGGML_AVX512_VBMI=$avx512 -DGGML_AVX512_VNNI=$avx512 -DGGML_AVX512_BF16=$avx512 \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
targets="llama-bench"
if [ "$server" = ON ]; then targets="$targets llama-server"; fi
cmake --build "$build" --target $targets -j2
cp "$build/bin/llama-bench" "$bin"
if [ "$server" = ON ]; then cp "$build/bin/llama-server" "$(dirname "$bin")/llama-server"; fi
echo "llama-bench: $bin (llama.cpp $(git -C "$llama" rev-parse --short HEAD 2>/dev/null || echo '?'))"
