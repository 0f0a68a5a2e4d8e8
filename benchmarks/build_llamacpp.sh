#!/bin/sh
# `make peers`: llama.cpp's ggml, built once under build/peers/ (ignored by git), for
# benchmarks/bench_llamacpp.py.  Nothing of llama.cpp enters the repository.
#
#   1. pip download the pinned sdist llama-cpp-python==$LLAMACPP_VERSION (it vendors a
#      llama.cpp with the deepseek4 architecture and the CPU lightning-indexer op);
#   2. unpack it; configure the vendored tree with cmake (CPU only, -DGGML_NATIVE=ON,
#      -DLLAMA_CURL=OFF, shared libraries);
#   3. build only the ggml libraries (ggml, ggml-base, ggml-cpu) -- and test-backend-ops
#      when PEERS_TEST_BACKEND_OPS=1, the targets in PEERS_EXTRA_TARGETS (llama-bench
#      with LLAMA_BUILD_TOOLS=ON) when set -- under `nice -n 19` with PEERS_JOBS (default 2) jobs;
#   4. compile benchmarks/llamacpp_ops.c against them into build/peers/libcsa_ggml_ops.so;
#   5. when libllama exists (PEERS_EXTRA_TARGETS="llama ..."), compile
#      benchmarks/llamacpp_model.c against it into build/peers/llamacpp_model (the
#      whole-model runs of benchmarks/bench_llamacpp_model.py).
# Each step is skipped when its output exists; PEERS_DIR moves the whole thing.
# PEERS_GGML_ISA=avx2 builds a second copy limited to AVX2/FMA/F16C (GGML_NATIVE=OFF)
# into llama-build-avx2/ + libcsa_ggml_ops-avx2.so, to set beside our AVX2 path
# (DEEPSEEK_CSA_ISA=avx2 ... bench_llamacpp.py --ggml-isa avx2) on an AVX-512 / AMX host.
# PEERS_GGML_ISA=noamx: AVX-512 (+VNNI, BF16) without AMX into llama-build-noamx/ (only
# ggml is needed there: bench_llamacpp_model.py loads the native libllama over it).
set -eu

VERSION=${LLAMACPP_VERSION:-0.3.36}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${PEERS_DIR:-$ROOT/build/peers}
PY=${PY:-$ROOT/.venv/bin/python}
JOBS=${PEERS_JOBS:-2}
SRC=$DIR/llama_cpp_python-$VERSION
LLAMA=$SRC/vendor/llama.cpp
GISA=${PEERS_GGML_ISA:-native}
case "$GISA" in
    native) BLD=$DIR/llama-build; LIB=$DIR/libcsa_ggml_ops.so
            ISAFLAGS="-DGGML_NATIVE=ON" ;;
    avx2)   BLD=$DIR/llama-build-avx2; LIB=$DIR/libcsa_ggml_ops-avx2.so
            ISAFLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
    # AVX-512 as native but without the AMX extra buffer: on the AMX test host the
    # whole-model graph with Q8_0 weights in ggml's AMX buffer cannot be scheduled
    # (docs/peers.md section 7); bench_llamacpp_model.py runs libllama over this ggml.
    noamx)  BLD=$DIR/llama-build-noamx; LIB=$DIR/libcsa_ggml_ops-noamx.so
            ISAFLAGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" ;;
    *) echo "make peers: PEERS_GGML_ISA must be native, avx2 or noamx, not $GISA" >&2; exit 2 ;;
esac

missing=""
command -v cmake >/dev/null 2>&1 || missing="$missing cmake"
CC=${CC:-cc}
CXX=${CXX:-c++}
command -v "$CC" >/dev/null 2>&1 || missing="$missing a C compiler ($CC)"
command -v "$CXX" >/dev/null 2>&1 || missing="$missing a C++ compiler ($CXX)"
if [ -n "$missing" ]; then
    echo "make peers: missing:$missing.  llama.cpp's ggml is built from source with cmake and a" >&2
    echo "C/C++ compiler (Debian/Ubuntu: apt-get install cmake g++; or pip install cmake)." >&2
    exit 2
fi
[ -x "$PY" ] || PY=python3

mkdir -p "$DIR"
TARBALL=$DIR/llama_cpp_python-$VERSION.tar.gz
if [ ! -f "$TARBALL" ]; then
    echo "peers: fetching llama-cpp-python==$VERSION (sdist) with pip into $DIR"
    # pip prepares the sdist's metadata, which needs its build backend
    # (scikit-build-core): let pip put it in an isolated build env (wheels allowed
    # there; only the package itself must come as the sdist).
    "$PY" -m pip download -q --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$VERSION" -d "$DIR"
fi
if [ ! -f "$LLAMA/ggml/include/ggml.h" ]; then
    echo "peers: unpacking $TARBALL"
    tar xzf "$TARBALL" -C "$DIR"
fi
[ -f "$LLAMA/src/models/deepseek4.cpp" ] || { echo "peers: $LLAMA has no deepseek4 model" >&2; exit 3; }

if [ ! -f "$BLD/CMakeCache.txt" ]; then
    echo "peers: configuring $LLAMA (CPU only, $ISAFLAGS)"
    # shellcheck disable=SC2086
    cmake -S "$LLAMA" -B "$BLD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        $ISAFLAGS -DGGML_BACKEND_DL=OFF -DGGML_OPENMP=ON -DGGML_BLAS=OFF \
        -DGGML_CCACHE=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=ON \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
fi
TARGETS="ggml ggml-cpu"
[ "${PEERS_TEST_BACKEND_OPS:-0}" = 1 ] && TARGETS="$TARGETS test-backend-ops"
if [ -n "${PEERS_EXTRA_TARGETS:-}" ]; then
    # e.g. PEERS_EXTRA_TARGETS=llama-bench for whole-model runs (issue 27
    # item 3): the tools need LLAMA_BUILD_TOOLS and libllama (tens of minutes more)
    cmake -S "$LLAMA" -B "$BLD" -DLLAMA_BUILD_TOOLS=ON >/dev/null
    TARGETS="$TARGETS $PEERS_EXTRA_TARGETS"
fi
echo "peers: building $TARGETS (nice -n 19, $JOBS jobs; ~20 min on 2 cores the first time)"
nice -n 19 cmake --build "$BLD" -j "$JOBS" --target $TARGETS >"$BLD/build.log" 2>&1 || {
    tail -30 "$BLD/build.log" >&2; echo "peers: build failed, log: $BLD/build.log" >&2; exit 4; }

if [ ! -f "$LIB" ] || [ "$ROOT/benchmarks/llamacpp_ops.c" -nt "$LIB" ]; then
    echo "peers: compiling benchmarks/llamacpp_ops.c -> $LIB"
    "$CC" -O2 -shared -fPIC -o "$LIB" "$ROOT/benchmarks/llamacpp_ops.c" \
        -I"$LLAMA/ggml/include" -L"$BLD/bin" -lggml -lggml-base -lggml-cpu \
        -Wl,-rpath,"$BLD/bin" -lm
fi
# the whole-model harness (issue 27 items 3-4), when libllama was built
# (PEERS_EXTRA_TARGETS containing llama or llama-bench)
HARN=$DIR/llamacpp_model
[ "$GISA" = native ] || HARN=$DIR/llamacpp_model-$GISA
if [ -f "$BLD/bin/libllama.so" ] && { [ ! -x "$HARN" ] || [ "$ROOT/benchmarks/llamacpp_model.c" -nt "$HARN" ]; }; then
    echo "peers: compiling benchmarks/llamacpp_model.c -> $HARN"
    "$CC" -O2 -o "$HARN" "$ROOT/benchmarks/llamacpp_model.c" -I"$LLAMA/include" \
        -I"$LLAMA/ggml/include" -L"$BLD/bin" -lllama -lggml -lggml-base \
        -Wl,-rpath,"$BLD/bin"
fi
echo "peers: llama.cpp $VERSION ggml in $BLD/bin, harness $LIB"
[ -x "$HARN" ] && echo "peers: model harness $HARN; run  .venv/bin/python benchmarks/bench_llamacpp_model.py [--quick]"
echo "peers: run  .venv/bin/python benchmarks/bench_llamacpp.py [--quick]"
