#!/usr/bin/env bash
# NGRAM_ADAPTIVE of another version of this project against this checkout's, in one call on one machine: the other
# version's plugin (its source tree in REF_SRC, e.g. `git archive REV | tar -x -C REF_SRC`) serves the `adaptive`
# configuration first, then this checkout's serves `plain,adaptive`; every configuration is a server process of its
# own (scripts/sglang_engine_bench.py), SmolLM2-135M-Instruct float16, the sets of docs/sglang.md. Results:
# $OUT/ab/{ref,this}.json (default OUT=out/sglang). Run after `source .gpukit/device/env.sh` (docs/sglang.md), which
# installs this checkout into $GPUKIT_RUN/proj. THIS_FIRST=1 runs this checkout's servers first (server processes
# started later in a call have run at a different host speed: run both orders, or read the host-time table, which
# puts SGLang's own per-step host work beside the plugin's).
#   [THIS_FIRST=1] [CONC="1 16"] [EXTRA=JSON_WITHOUT_SPACES] bash scripts/sglang_ab.sh MODEL_DIR REF_SRC
set -uo pipefail
cd "$(dirname "$0")/.."
MODEL=$1; REF=$2; OUT=${OUT:-out/sglang}; W=${GPUKIT_RUN:?source .gpukit/device/env.sh first}
mkdir -p "$OUT/ab"
rm -rf "$W/projref" && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --target "$W/projref" "$REF" || exit 5
BENCH="python3 scripts/sglang_engine_bench.py --model $MODEL --dtype float16 --prompts-per-set 16 --max-new-tokens 256
  --concurrency ${CONC:-1 16} --timeout 300 --sched-profile ${EXTRA:+--extra $EXTRA}"
BASE=${PYTHONPATH:?}
run_ref() {
  PYTHONPATH=${BASE//$W\/proj/$W\/projref} $BENCH --configs adaptive --out "$OUT/ab/ref.json" --logs "$OUT/ab/logs_ref" \
    | grep -E "^adaptive +(copy|free)|Triton"
}
run_this() {
  PYTHONPATH=$BASE $BENCH --configs plain,adaptive --out "$OUT/ab/this.json" --logs "$OUT/ab/logs_this" \
    | grep -E "^(plain|adaptive) +(copy|free)|Triton"
}
if [ "${THIS_FIRST:-0}" = 1 ]; then run_this; run_ref; else run_ref; run_this; fi
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
# host ms per verify step (ref / this): the plugin's launch and its parts, beside SGLang's own host work per step
print(f"{'set':10s} {'verify launch':>14s} {'prepare':>12s} {'sample':>12s} {'after':>12s} {'forward call':>13s}"
      f" {'SGLang prepare_for_decode':>26s}")
for run in plain:
    cells = []
    for key in ("launch_ms", "verify_prepare_ms", "verify_sample_ms", "verify_after_ms", "forward_call_ms"):
        v = [res["adaptive"]["runs"][run]["profile"].get("host_ms_by_kind", {}).get("verify", {}).get(key)
             for res in (ref, this)]
        cells.append(" / ".join("-" if x is None else f"{x:.2f}" for x in v))
    s = [res["adaptive"]["runs"][run].get("scheduler", {}).get("prepare_for_decode_ms") for res in (ref, this)]
    cells.append(" / ".join("-" if x is None else f"{x:.3f}" for x in s))
    print(f"{run:10s} {cells[0]:>14s} {cells[1]:>12s} {cells[2]:>12s} {cells[3]:>12s} {cells[4]:>13s} {cells[5]:>26s}")
PY
