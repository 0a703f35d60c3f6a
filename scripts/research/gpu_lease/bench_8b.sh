# 8B cost: SmolLM2 zero-padded to 7.48B (built beside it once), c16 sets timed three times; MORE: more arguments of
# the engine bench (e.g. "--preamble-tokens 4000": every prompt behind a long system prompt, as in agents' requests)
source scripts/research/gpu_lease/model.sh
OUT=$OUT TAG=${TAG:-} BENCH_ARGS="--repeats 3 ${MORE:-}" timeout -k 5 ${T:-540} bash scripts/sglang_gpu_runs.sh dense8b \
  /root/m/smollm2 ${CONFIGS:-plain,adaptive} > $OUT/dense8b${TAG:-}_console.txt 2>&1
echo "rc $? $(date +%T)"; cleanup
tail -c 2500 $OUT/dense8b${TAG:-}_console.txt
python3 scripts/sglang_engine_bench.py --out $OUT/dense8b${TAG:-}.json --summary 2>&1 | tail -60
gzip -f $OUT/dense8b${TAG:-}.json; rm -rf $OUT/logs_dense8b${TAG:-}/*.profile* 2>/dev/null; true
