# Does a dropped `preplan` hand unwritten draft-token rows to a CUDA graph? SmolLM2 itself. B: the fixed code (zeros):
# plain, preplan and the defaults (CONFIGS) at c1 and c16 (B_CONC); it also warms SGLang's JIT kernels (a short
# warm-up instead: CONFIGS=plain B_CONC=16). A: the draft-token buffer filled with an out-of-vocabulary id at start-up
# (what torch.empty may return), preplan on, c16 sets (batches that shrink through padded graph sizes). Last, if the
# call's time allows, A0: the same fill with preplan off (the control). Servers' logs come back under $OUT/logs.
source scripts/research/gpu_lease/model.sh
F=$W/proj/ngramspec_sglang/worker_startup.py
B="python3 scripts/sglang_engine_bench.py --model /root/m/smollm2 --dtype float16 --prompts-per-set 16 --max-new-tokens 256 --sched-profile"
poison() { cp /tmp/ws.bak "$F"; sed -i 's/self.draft_tokens = torch.zeros(bs \* w, \*\*long)/self.draft_tokens = torch.full((bs * w,), 2**40, **long)/' "$F"; echo "poisoned lines: $(grep -c '2\*\*40' "$F")"; }
summary() { python3 scripts/sglang_engine_bench.py --out "$1" --summary 2>&1 | tail -${2:-30}; python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, r in d.get("results", {}).items():
    s = json.dumps(r)
    i = s.find("preplan")
    print(name, "| error:", str(r.get("error"))[:300] if isinstance(r, dict) else None, "| preplan:", s[i:i+200] if i >= 0 else "-")
PY
}
cp "$F" /tmp/ws.bak
# B first: its start-ups build SGLang's JIT kernels, so A's server is not the machine's first (the first run of
# this script had A stall in its first CUDA graph capture while a JIT build failed, before any request)
timeout -k 5 ${TB:-320} $B --out $OUT/smollm2_pp.json --logs /tmp/logs_pp --concurrency ${B_CONC:-1 16} --repeats 3 \
  --configs ${CONFIGS:-plain,adaptive_pp,adaptive} --timeout ${CTB:-130} > /tmp/pb.txt 2>&1
echo "B rc $? $(date +%T)"; cleanup
summary $OUT/smollm2_pp.json 60
poison
# SGLang's async bounds check on the embedding's ids names the failing kernel ("VocabParallelEmbedding input id")
SGLANG_ENABLE_ASYNC_ASSERT=1 timeout -k 5 ${TA:-125} $B --out $OUT/poison.json --logs /tmp/logs_poison --concurrency 16 --repeats 3 \
  --configs adaptive_pp --timeout ${CTA:-115} > /tmp/pa.txt 2>&1
echo "A rc $? $(date +%T)"; cleanup
grep -h -m5 -i "assert\|AcceleratorError\|input id" /tmp/pa.txt /tmp/logs_poison/*.log 2>/dev/null | cut -c1-300
summary $OUT/poison.json 20
cp /tmp/ws.bak "$F"; echo "restored: $(grep -c '2\*\*40' "$F")"
poison
SGLANG_ENABLE_ASYNC_ASSERT=1 timeout -k 5 ${TA0:-115} $B --out $OUT/poison_off.json --logs /tmp/logs_poison0 --concurrency 16 --repeats 3 \
  --configs adaptive_nopp --timeout ${TA0:-115} > /tmp/pa0.txt 2>&1
echo "A0 rc $? $(date +%T)"; cleanup; cp /tmp/ws.bak "$F"
grep -h -m5 -i "assert\|AcceleratorError\|input id" /tmp/pa0.txt /tmp/logs_poison0/*.log 2>/dev/null | cut -c1-300
summary $OUT/poison_off.json 20
mkdir -p $OUT/logs && for d in poison pp poison0; do cp -r /tmp/logs_$d $OUT/logs/$d 2>/dev/null; done
gzip -f $OUT/*.json; true
