# Does a dropped `preplan` hand unwritten draft-token rows to a CUDA graph? SmolLM2 itself, c16 sets (batches that
# shrink through padded graph sizes). A: the draft-token buffer filled with an out-of-vocabulary id at start-up (what
# torch.empty may return), preplan on; A0: the same poison, preplan off (control); then the fixed code (zeros):
# plain, the defaults and preplan, c1 and c16.
source scripts/research/gpu_lease/model.sh
F=$W/proj/ngramspec_sglang/worker_startup.py
B="python3 scripts/sglang_engine_bench.py --model /root/m/smollm2 --dtype float16 --prompts-per-set 16 --max-new-tokens 256 --sched-profile"
cp "$F" /tmp/ws.bak
sed -i 's/self.draft_tokens = torch.zeros(bs \* w, \*\*long)/self.draft_tokens = torch.full((bs * w,), 2**40, **long)/' "$F"
echo "poisoned lines: $(grep -c '2\*\*40' "$F")"
timeout -k 5 ${TA:-230} $B --out $OUT/poison.json --logs /tmp/logs_poison --concurrency 16 --repeats 3 \
  --configs adaptive_pp,adaptive_nopp --timeout ${CTA:-110} > /tmp/pa.txt 2>&1
echo "A rc $? $(date +%T)"; cleanup
grep -h -m3 -i "assert\|AcceleratorError\|input id" /tmp/pa.txt; tail -c 1500 /tmp/pa.txt
python3 scripts/sglang_engine_bench.py --out $OUT/poison.json --summary 2>&1 | tail -25
cp /tmp/ws.bak "$F"; echo "restored: $(grep -c '2\*\*40' "$F")"
timeout -k 5 ${TB:-320} $B --out $OUT/smollm2_pp.json --logs /tmp/logs_pp --concurrency 1 16 --repeats 3 \
  --configs ${CONFIGS:-plain,adaptive_pp,adaptive} --timeout ${CTB:-130} > /tmp/pb.txt 2>&1
echo "B rc $? $(date +%T)"; cleanup
tail -c 1500 /tmp/pb.txt
python3 scripts/sglang_engine_bench.py --out $OUT/smollm2_pp.json --summary 2>&1 | tail -60
for f in poison smollm2_pp; do python3 - "$OUT/$f.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, r in d.get("results", {}).items():
    s = json.dumps(r)
    i = s.find("preplan")
    print(name, "error:", str(r.get("error"))[:300] if isinstance(r, dict) else None, "| preplan counts:", s[i:i+160] if i >= 0 else "-")
PY
done
gzip -f $OUT/poison.json $OUT/smollm2_pp.json; true
