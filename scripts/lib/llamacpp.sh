# The llama.cpp peer of the benchmarks: llama.cpp's own binaries (llama-bench, llama-batched-bench,
# llama-server, llama-quantize, llama-simple), built once from the llama.cpp vendored in the PyPI
# sdist of llama-cpp-python into build-peer/llama.cpp (git-ignored). Source it after
# scripts/lib/common.sh (it sources that itself when needed); do not run it.
#   ensure_llamacpp_peer   # builds if a binary is missing; exports LLAMACPP_BIN, sets LLAMACPP_ENV
#   "${LLAMACPP_ENV[@]}" "$LLAMACPP_BIN/llama-bench" ...   # how the scripts run a peer binary
# LLAMACPP_OMP_WAIT_POLICY=passive (say) runs the peer with OMP_WAIT_POLICY set so (kvshard sets
# passive for itself, cli/main.cc); unset, llama.cpp keeps its own default (libgomp spins), which
# is fastest on an idle machine and several times slower when other processes want the cores.
# The first build takes 10-20 minutes on 2 cores; later calls return at once.

[ -n "${KVSHARD_ROOT:-}" ] || source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

LLAMACPP_PY_VERSION="${LLAMACPP_PY_VERSION:-0.3.36}"  # llama-cpp-python sdist that vendors llama.cpp
LLAMACPP_PEER_DIR="${LLAMACPP_PEER_DIR:-$KVSHARD_ROOT/build-peer}"
LLAMACPP_BUILD_DIR="$LLAMACPP_PEER_DIR/llama.cpp"
LLAMACPP_TARGETS=(llama-bench llama-batched-bench llama-server llama-quantize llama-simple)

# CPU build for the development machines (AVX-512 Xeons). GGML_NATIVE=OFF so the flags are what
# is written here; AMX off: ggml's AMX path dies with SIGILL on these virtual machines. No curl, no
# OpenSSL, no web UI download (there is no network but the package registries).
LLAMACPP_CMAKE_FLAGS=(
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_APP=OFF -DGGML_CCACHE=OFF
)

_llamacpp_have_binaries() {
  local t
  for t in "${LLAMACPP_TARGETS[@]}"; do [ -x "$LLAMACPP_BUILD_DIR/bin/$t" ] || return 1; done
}

# The vendored llama.cpp source tree of the sdist; downloads and unpacks it when missing. Prints
# its path.
ensure_llamacpp_source() {
  local dir="$LLAMACPP_PEER_DIR/src/llama_cpp_python-$LLAMACPP_PY_VERSION"
  if [ ! -f "$dir/vendor/llama.cpp/CMakeLists.txt" ]; then
    mkdir -p "$LLAMACPP_PEER_DIR/src"
    local sdist="$LLAMACPP_PEER_DIR/src/llama_cpp_python-$LLAMACPP_PY_VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
      log "downloading the llama-cpp-python $LLAMACPP_PY_VERSION sdist (PyPI)"
      python3 -m pip download --quiet --disable-pip-version-check --no-binary :all: --no-deps \
        "llama-cpp-python==$LLAMACPP_PY_VERSION" -d "$LLAMACPP_PEER_DIR/src" >&2 || {
        log "could not download llama-cpp-python==$LLAMACPP_PY_VERSION from PyPI"; return 1; }
    fi
    tar -xzf "$sdist" -C "$LLAMACPP_PEER_DIR/src"
  fi
  echo "$dir/vendor/llama.cpp"
}

ensure_llamacpp_peer() {
  export LLAMACPP_BIN="$LLAMACPP_BUILD_DIR/bin"
  LLAMACPP_ENV=(env)
  if [ -n "${LLAMACPP_OMP_WAIT_POLICY:-}" ]; then
    LLAMACPP_ENV+=("OMP_WAIT_POLICY=$LLAMACPP_OMP_WAIT_POLICY")
    log "llama.cpp peer runs with OMP_WAIT_POLICY=$LLAMACPP_OMP_WAIT_POLICY"
  fi
  _llamacpp_have_binaries && return 0
  if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then ensure_debian_packages; fi
  local src; src="$(ensure_llamacpp_source)" || return 1
  local logf="$LLAMACPP_PEER_DIR/build.log"
  log "building llama.cpp (llama-cpp-python $LLAMACPP_PY_VERSION's vendor/llama.cpp) into $LLAMACPP_BUILD_DIR; log: $logf"
  if ! { cmake -S "$src" -B "$LLAMACPP_BUILD_DIR" "${LLAMACPP_CMAKE_FLAGS[@]}" &&
         nice -n 10 cmake --build "$LLAMACPP_BUILD_DIR" -j"${KVSHARD_JOBS:-2}" \
           --target "${LLAMACPP_TARGETS[@]}"; } >"$logf" 2>&1; then
    tail -n 30 "$logf" >&2
    log "the llama.cpp build failed; see $logf"
    return 1
  fi
  _llamacpp_have_binaries || { log "llama.cpp built but $LLAMACPP_BIN lacks a binary"; return 1; }
}
