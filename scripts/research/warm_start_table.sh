#!/usr/bin/env bash
# Start warm vs cold: the adaptive controller started from a state learned on other requests (never the ones it
# is evaluated on) against a cold start, plain decoding and the oracle controller; batch 1, both profiles.
#   cross-trace: evaluate each dev trace (first 1,000 requests = whole) warm from a state learned on another
#                trace (chat <- reasoning, every other trace <- chat)
#   split:       same trace, learn on requests n+1..2n, evaluate on requests 1..n (MT-bench 80, chat 250,
#                reasoning 375)
# About 25 minutes on the 2-core dev machine. Writes $OUT_DIR/warm/*.json.
set -eu  # no pipefail: zcat | head ends zcat early by design
cd "$(dirname "$0")/../.."
T=../shared/traces
OUT=${OUT_DIR:-out}/warm
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
P=(--profile h200-llama8b --profile seed-pcie8 --batch 1 --no-progress)
for tr in chat_gpt4 reasoning_o3mini; do  # learn: a cold run that writes its state at the end
  $PY -m ngramspec simulate $T/$tr.jsonl.gz --method "ngramspec-adaptive:state_out=$OUT/state-$tr-{profile}.npz" \
    "${P[@]}" --max-requests 1000 --json "$OUT/learn-$tr.json"
done
for pair in chat_gpt4:reasoning_o3mini reasoning_o3mini:chat_gpt4 mtbench_vicuna7b:chat_gpt4 agent_swe_gpt4_dev:chat_gpt4; do
  ev=${pair%%:*}; src=${pair##*:}
  $PY -m ngramspec simulate $T/$ev.jsonl.gz --method ngramspec-adaptive \
    --method "ngramspec-adaptive:state_in=$OUT/state-$src-{profile}.npz" --method oracle-ctl:k=15 \
    "${P[@]}" --max-requests 1000 --json "$OUT/cross-$ev.json"
done
for split in mtbench_vicuna7b:80 chat_gpt4:250 reasoning_o3mini:375; do
  tr=${split%%:*}; n=${split##*:}
  zcat $T/$tr.jsonl.gz | head -n "$n" | gzip > "$OUT/${tr}_first$n.jsonl.gz"
  zcat $T/$tr.jsonl.gz | tail -n +$((n + 1)) | head -n "$n" | gzip > "$OUT/${tr}_next$n.jsonl.gz"
  $PY -m ngramspec simulate "$OUT/${tr}_next$n.jsonl.gz" \
    --method "ngramspec-adaptive:state_out=$OUT/state-${tr}_next$n-{profile}.npz" "${P[@]}" --json "$OUT/split-learn-$tr.json"
  $PY -m ngramspec simulate "$OUT/${tr}_first$n.jsonl.gz" --method ngramspec-adaptive \
    --method "ngramspec-adaptive:state_in=$OUT/state-${tr}_next$n-{profile}.npz" --method oracle-ctl:k=15 \
    "${P[@]}" --json "$OUT/split-$tr.json"
done
