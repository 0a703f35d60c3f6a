# both 5-minute soaks at once on one GPU: NGRAM_ADAPTIVE (defaults) and plain
source scripts/research/gpu_lease/model.sh
for a in NGRAM_ADAPTIVE plain; do
  p=$([ $a = plain ] && echo 30200 || echo 30100); o=/tmp/soak_$a
  setsid timeout -k 5 ${TS:-540} python3 scripts/sglang_soak.py --model /root/m/smollm2 --load-from-ready \
    --minutes ${MIN:-5} --mem-fraction 0.35 --max-total-tokens 300000 --algorithm $a --port $p --out $o \
    > /tmp/soak_$a.txt 2>&1 &
done
s=0; while [ $s -lt ${WAIT:-520} ] && pgrep -f "[s]glang_soak.py" > /dev/null; do sleep 5; s=$((s + 5)); done
echo "waited $s s $(date +%T)"
for a in NGRAM_ADAPTIVE plain; do
  echo "== $a"; tail -c 2500 /tmp/soak_$a.txt
  [ -f /tmp/soak_$a/soak.json ] && gzip -c /tmp/soak_$a/soak.json > $OUT/soak_$a.json.gz
done
ls /tmp/soak_NGRAM_ADAPTIVE
[ -f /tmp/soak_plain/soak.json ] && python3 scripts/sglang_soak.py --compare /tmp/soak_NGRAM_ADAPTIVE/soak.json \
  /tmp/soak_plain/soak.json 2>&1 | tail -60
