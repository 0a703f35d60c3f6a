#!/usr/bin/env bash
# The SGLang server checks of docs/sglang.md, on a GPU machine with SGLang 0.5.23 (for this project's test
# machines: after `source .gpukit/device/env.sh`, see docs/sglang.md). Results land in $OUT (default ./out/sglang).
#   bash scripts/sglang_gpu_runs.sh tiny            # random-weight Llama: fixed width 1 vs plain; TP=2 vs TP=1 (2 GPUs)
#   bash scripts/sglang_gpu_runs.sh smollm2 MODEL   # SmolLM2-135M-Instruct float16: plain, NGRAM, NGRAM_ADAPTIVE
#   bash scripts/sglang_gpu_runs.sh dummy8b         # Llama-8B-shaped random weights: host overhead at real step costs
#   bash scripts/sglang_gpu_runs.sh dense8b SMOLLM2 [configs]  # SmolLM2 zero-padded to 7.48B: real text, 8B step cost
#   bash scripts/sglang_gpu_runs.sh moe SMOLLM2 [configs]      # SmolLM2 as a 16-expert top-2 Mixtral (40 GB, sparse
#                                                   # file): a verify reads more experts the wider it is
#   bash scripts/sglang_gpu_runs.sh moe64 SMOLLM2 [configs]    # SmolLM2 as a 64-expert top-8 Mixtral (60 GB, sparse
#                                                   # file): a verify costs 2.6-3x a decode step at batch 1
#   (SMOLLM2: SmolLM2-135M-Instruct as a float16 Hugging Face folder; the padded model is built once beside it, see
#    scripts/pad_model.py. SWEEP=1 first measures the step cost of every width: the adaptive_sweep config, short.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/sglang}; mkdir -p "$OUT"
BENCH="python3 scripts/sglang_engine_bench.py"
case "${1:-}" in
  tiny)
    M=${GPUKIT_RUN:-/tmp}/tiny-llama
    [ -f "$M/model.safetensors" ] || python3 .gpukit/device/make_tiny_llama.py "$M" > /dev/null
    $BENCH --model "$M" --dtype bfloat16 --out "$OUT/tiny_tp1.json" --logs "$OUT/logs_tp1" --prompts-per-set 4 \
      --max-new-tokens 128 --concurrency 1 4 --configs "${2:-plain,adaptive_w1,adaptive,ngram}" --timeout 300 \
      --sched-profile
    if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
      NGRAMSPEC_DRAFT_LOG="$OUT/drafts_tp2" $BENCH --model "$M" --dtype bfloat16 --tp 2 --out "$OUT/tiny_tp2.json" \
        --logs "$OUT/logs_tp2" --prompts-per-set 4 --max-new-tokens 128 --concurrency 1 4 --configs plain,adaptive \
        --timeout 300
      python3 - "$OUT" <<'PY'
import json, sys, filecmp
out = sys.argv[1]
tp1, tp2 = (json.load(open(f"{out}/tiny_{t}.json")) for t in ("tp1", "tp2"))
for run, r in tp2["adaptive"]["runs"].items():
    for ref_name in ("plain", "adaptive"):
        ref = tp1[ref_name]["runs"][run]["output_ids"]
        same = sum(a == b for a, b in zip(ref, r["output_ids"]))
        print(f"TP=2 adaptive {run}: {same}/{len(ref)} outputs equal TP=1 {ref_name}")
a, b = (open(f"{out}/drafts_tp2.rank{k}").read().splitlines() for k in (0, 1))
print(f"draft hashes: rank0 {len(a)} steps, rank1 {len(b)} steps, identical: {a == b}")
PY
    fi
    ;;
  dummy8b)
    # Llama-3-8B-shaped, random weights drawn by SGLang at load (no checkpoint), the tiny model's byte tokenizer:
    # step costs like a production model's at batch 1-16 (GPU-bound), outputs meaningless
    T=${GPUKIT_RUN:-/tmp}/tiny-llama; M=${GPUKIT_RUN:-/tmp}/llama8b-dummy
    [ -f "$T/model.safetensors" ] || python3 .gpukit/device/make_tiny_llama.py "$T" > /dev/null
    mkdir -p "$M" && cp "$T"/tokenizer* "$T"/special_tokens_map.json "$M"/ 2>/dev/null
    python3 - "$T" "$M" <<'PY'
import json, sys
cfg = json.load(open(f"{sys.argv[1]}/config.json"))
cfg.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
           num_key_value_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=8192)
json.dump(cfg, open(f"{sys.argv[2]}/config.json", "w"), indent=1)
PY
    $BENCH --model "$M" --dtype bfloat16 --extra '{"load_format": "dummy"}' --out "$OUT/dummy8b.json" \
      --logs "$OUT/logs_dummy8b" --prompts-per-set "${PROMPTS:-8}" --max-new-tokens "${TOKENS:-128}" \
      --concurrency 1 16 --configs "${2:-plain,adaptive_w1,adaptive,ngram}" --timeout 400 --sched-profile
    ;;
  smollm2)
    $BENCH --model "$2" --dtype float16 --out "$OUT/smollm2.json" --logs "$OUT/logs_smollm2" --prompts-per-set 16 \
      --max-new-tokens 256 --concurrency 1 16 --configs "${3:-plain,ngram,adaptive,adaptive_cw}" --timeout 400 --sched-profile \
      ${BENCH_ARGS:-}
    ;;
  dense8b|moe|moe64)
    if [ "$1" = moe64 ]; then
      PAD_ARGS=${PAD_ARGS:-"--experts 64 --top-k 8 --intermediate 8448"}
      EXTRA=${EXTRA:-'{"mem_fraction_static": 0.7}'}  # 60 GB of weights: the default 0.5 leaves too little KV cache
    fi
    # EXTRA: a JSON object of more sglang.Engine arguments (e.g. '{"mem_fraction_static": 0.85}' for an 80 GB model)
    # BENCH_ARGS: more arguments of the engine bench (e.g. "--kernel-profile 32")
    # PAD_ARGS: sizes for scripts/pad_model.py (e.g. PAD_ARGS="--top-k 1 --intermediate 45056"), one model folder each
    M=${PADDED:-$(dirname "$2")/smollm2-$1$(echo "${PAD_ARGS:-}" | tr -dc 'a-z0-9')}
    if [ ! -f "$M/model.safetensors" ]; then
      # shellcheck disable=SC2086
      python3 scripts/pad_model.py "$([ "$1" = dense8b ] && echo dense || echo moe)" "$2" "$M" ${PAD_ARGS:-} \
        | tee "$OUT/$1${TAG:-}_build.json"
    fi
    if [ "${SWEEP:-0}" = 1 ]; then
      $BENCH --model "$M" --dtype float16 --out "$OUT/$1_sweep.json" --logs "$OUT/logs_$1_sweep" --prompts-per-set 16 \
        --max-new-tokens 48 --warm-prompts 2 --concurrency 1 16 --configs adaptive_sweep --timeout 300 --sched-profile \
        ${EXTRA:+--extra "$EXTRA"}
    fi
    # shellcheck disable=SC2086
    $BENCH --model "$M" --dtype float16 --out "$OUT/$1${TAG:-}.json" --logs "$OUT/logs_$1${TAG:-}" --prompts-per-set 16 \
      --max-new-tokens 256 --concurrency 1 16 --configs "${3:-plain,adaptive,ngram8,ngram}" --timeout 420 --sched-profile \
      ${EXTRA:+--extra "$EXTRA"} ${BENCH_ARGS:-}
    ;;
  *) echo "usage: $0 tiny | smollm2 MODEL_DIR [configs] | dense8b|moe|moe64 SMOLLM2_DIR [configs] | dummy8b" >&2; exit 2 ;;
esac
