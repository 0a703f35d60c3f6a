# SmolLM2-135M itself (host-bound): plain, without preplan, the defaults; c16 sets timed R times
source scripts/research/gpu_lease/model.sh
timeout -k 5 ${T:-500} python3 scripts/sglang_engine_bench.py --model /root/m/smollm2 --dtype float16 \
  --out $OUT/smollm2${TAG:-}.json --logs /tmp/logs_smollm2 --prompts-per-set 16 --max-new-tokens 256 \
  --concurrency 1 16 --configs ${CONFIGS:-plain,adaptive_nopp,adaptive} --timeout ${CT:-240} --sched-profile \
  --repeats ${R:-3} > $OUT/smollm2${TAG:-}_console.txt 2>&1
echo "rc $? $(date +%T)"; cleanup
tail -c 3000 $OUT/smollm2${TAG:-}_console.txt
python3 scripts/sglang_engine_bench.py --out $OUT/smollm2${TAG:-}.json --summary 2>&1 | tail -60
gzip -f $OUT/smollm2${TAG:-}.json
