# the sampling check (chi-square against plain decoding's samples) with the defaults
source scripts/research/gpu_lease/model.sh
timeout -k 5 ${T:-545} python3 scripts/sglang_sampling_check.py --model /root/m/smollm2 \
  --configs ${CONFIGS:-plain,adaptive_w8,adaptive} --budget ${B:-510} --mem-fraction 0.5 --max-total-tokens 300000 \
  --out $OUT/sampling${TAG:-}.json --logs /tmp/logs_sampling > $OUT/sampling${TAG:-}_console.txt 2>&1
echo "rc $? $(date +%T)"; cleanup
tail -c 6000 $OUT/sampling${TAG:-}_console.txt
[ -f $OUT/sampling${TAG:-}.json ] && gzip -f $OUT/sampling${TAG:-}.json
