#!/usr/bin/env bash
# The controller comparison table: adaptive vs every static chain/tree k in {2,4,8,16} vs the oracle controller,
# on every dev trace, both profiles, batch 1 and 32. Chat and reasoning can be cut to their first N requests
# (MAXREQ, default 0 = whole traces; about 17 minutes on the 2-core dev machine).
set -euo pipefail
cd "$(dirname "$0")/../.."
T=../shared/traces
OUT=${OUT_DIR:-out}
mkdir -p "$OUT"
MAXREQ=${MAXREQ:-0}
PY=${PY:-.venv/bin/python}
methods=(--method none --method ngramspec-adaptive --method oracle-ctl:k=15)
for k in 2 4 8 16; do methods+=(--method ngramspec-chain:k=$k --method ngramspec-tree:k=$k); done
common=("${methods[@]}" --profile seed-pcie8 --profile h200-llama8b --batch 1 --batch 32 --jobs 2 --no-progress)
$PY -m ngramspec simulate $T/agent_swe_gpt4_dev.jsonl.gz $T/mtbench_vicuna7b.jsonl.gz "${common[@]}" --json "$OUT/ctl_small.json"
extra=(); [ "$MAXREQ" != 0 ] && extra=(--max-requests "$MAXREQ")
$PY -m ngramspec simulate $T/chat_gpt4.jsonl.gz $T/reasoning_o3mini.jsonl.gz "${common[@]}" "${extra[@]}" --json "$OUT/ctl_large.json"
$PY scripts/research/controller_report.py "$OUT/ctl_small.json" "$OUT/ctl_large.json"
# robustness to a wrong prior: started with the other profile's costs (reasoning trace, batch 1)
$PY -m ngramspec simulate $T/reasoning_o3mini.jsonl.gz --method none --method ngramspec-adaptive:prior=seed-pcie8 \
  --method ngramspec-adaptive:prior=h200-llama8b --profile seed-pcie8 --profile h200-llama8b --batch 1 --jobs 2 \
  --no-progress "${extra[@]}" --json "$OUT/ctl_prior.json"
