# 10-minute soak of the defaults, part 1: start it detached, wait up to WAIT_S s (part 2: soak10_collect.sh collects).
# EVERY later call while it runs must carry .kitdev: its stub/sitecustomize.py (the cutlass shim) is read by each
# python process SGLang spawns, and a call that does not carry .kitdev removes it from the checkout.
# (W is the kit's own variable, set by env.sh: never use it as a knob here.)
source scripts/research/gpu_lease/model.sh
(setsid timeout -k 5 ${TS:-860} python3 scripts/sglang_soak.py --model /root/m/smollm2 --load-from-ready \
  --minutes 10 --mem-fraction 0.35 --max-total-tokens 300000 --algorithm NGRAM_ADAPTIVE --port 30100 \
  --segment-grace 90 --out /tmp/soak10 > /tmp/soak10.txt 2>&1 &)
# BUILD8B=1: build the 8B-cost model (bench_8b.sh's) while the soak runs: CPU and disk work, not timed
[ "${BUILD8B:-0}" = 1 ] && [ ! -f /root/m/smollm2-dense8b/model.safetensors ] && \
  { python3 scripts/pad_model.py dense /root/m/smollm2 /root/m/smollm2-dense8b > /tmp/build8b.txt 2>&1; \
    echo "8B build rc $? $(date +%T)"; tail -3 /tmp/build8b.txt; }
s=0; while [ $s -lt ${WAIT_S:-555} ] && pgrep -f "[s]glang_soak.py" > /dev/null; do sleep 5; s=$((s + 5)); done
echo "waited $s s $(date +%T)"; tail -c 3000 /tmp/soak10.txt
