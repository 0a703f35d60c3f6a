# 8B cost through the HTTP server with SGLang's own client: the padded model (built here if an earlier call has not),
# then scripts/sglang_http_bench.py; http_dense8b${TAG}.json comes back with each gap's place in time
source scripts/research/gpu_lease/model.sh
M=/root/m/smollm2-dense8b
if [ ! -f "$M/model.safetensors" ]; then
  python3 scripts/pad_model.py dense /root/m/smollm2 "$M" > /tmp/pad.txt 2>&1 || { tail -20 /tmp/pad.txt; exit 8; }
fi
timeout -k 5 ${T:-560} python3 scripts/sglang_http_bench.py --model "$M" --out /tmp/http${TAG:-} \
  --configs ${CONFIGS:-plain,adaptive} --rates ${RATES:-inf,8} --warmup 200 > $OUT/http_dense8b${TAG:-}_console.txt 2>&1
echo "rc $? $(date +%T)"; cleanup
tail -c 4000 $OUT/http_dense8b${TAG:-}_console.txt
cp /tmp/http${TAG:-}/http_bench.json $OUT/http_dense8b${TAG:-}.json 2>/dev/null; true
