#!/usr/bin/env bash
# NGRAM_ADAPTIVE of another version of this project against this checkout's, in one call on one machine: the other
# version's plugin (its source tree in REF_SRC, e.g. `git archive REV | tar -x -C REF_SRC`) serves the `adaptive`
# configuration first, then this checkout's serves `plain,adaptive`; every configuration is a server process of its
# own (scripts/sglang_engine_bench.py), SmolLM2-135M-Instruct float16, the sets of docs/sglang.md. Results:
# $OUT/ab/{ref,this}.json (default OUT=out/sglang). Run after `source .gpukit/device/env.sh` (docs/sglang.md), which
# installs this checkout into $GPUKIT_RUN/proj.
#   bash scripts/sglang_ab.sh MODEL_DIR REF_SRC
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=$1; REF=$2; OUT=${OUT:-out/sglang}; W=${GPUKIT_RUN:?source .gpukit/device/env.sh first}
mkdir -p "$OUT/ab"
rm -rf "$W/projref" && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --target "$W/projref" "$REF" || exit 5
BENCH="python3 scripts/sglang_engine_bench.py --model $MODEL --dtype float16 --prompts-per-set 16 --max-new-tokens 256
  --concurrency 1 16 --timeout 300 --sched-profile"
BASE=${PYTHONPATH:?}
PYTHONPATH=${BASE//$W\/proj/$W\/projref} $BENCH --configs adaptive --out "$OUT/ab/ref.json" --logs "$OUT/ab/logs_ref" \
  | grep -E "^adaptive +(copy|free)|Triton"
PYTHONPATH=$BASE $BENCH --configs plain,adaptive --out "$OUT/ab/this.json" --logs "$OUT/ab/logs_this" \
  | grep -E "^(plain|adaptive) +(copy|free)|Triton"
python3 - "$OUT/ab" <<'PY'
import json, sys
ref, this = (json.load(open(f"{sys.argv[1]}/{n}.json")) for n in ("ref", "this"))
plain = this["plain"]["runs"]
print(f"{'set':10s} {'plain':>8s} {'ref':>16s} {'this':>16s}  outputs equal to plain: ref / this")
for run, p in plain.items():
    row = []
    for res in (ref, this):
        r = res["adaptive"]["runs"][run]
        same = sum(a == b for a, b in zip(p["output_ids"], r["output_ids"]))
        row.append((f"{r['tok_s']:.0f} ({r['tok_s'] / p['tok_s']:.2f}x)", same))
    print(f"{run:10s} {p['tok_s']:8.0f} {row[0][0]:>16s} {row[1][0]:>16s}  {row[0][1]} / {row[1][1]}")
PY
