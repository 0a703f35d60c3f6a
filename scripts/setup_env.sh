#!/usr/bin/env bash
# Create the virtualenvs on a fresh machine (idempotent). Usage: scripts/setup_env.sh core|sglang
#   core   -> .venv: ngramspec + simulator + CPU torch 2.13 + transformers/gguf/accelerate + SmolLM2 GGUF package
#   sglang -> .venv-sglang: ngramspec + its SGLang plugin + sglang 0.5.23 (~10 min, ~11 GB) + Arctic Inference (built from source)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
case "${1:-core}" in
  core)
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    .venv/bin/pip install -q "torch==2.13.0"
    .venv/bin/pip install -q -e ".[test,sim,engine,model]"
    ;;
  sglang)
    [ -x .venv-sglang/bin/python ] || "$PY" -m venv .venv-sglang
    .venv-sglang/bin/pip install -q -e ".[sglang,test,sim]" "sglang==0.5.23"  # the version the plugin is tested against
    .venv-sglang/bin/pip install -q "arctic-inference==0.3.0"
    ;;
  *) echo "usage: $0 core|sglang" >&2; exit 2 ;;
esac
