#!/usr/bin/env bash
# The main job (README): set up, then run plain greedy vs NGRAM_ADAPTIVE on SmolLM2-135M (CPU, or the GPU if any).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh demo
exec .venv/bin/ngramspec demo "$@"
