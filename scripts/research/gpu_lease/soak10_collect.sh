# 10-minute soak, part 2 (carry .kitdev): wait for it to end (at most WAIT_S s), bring back its result and logs
s=0; while [ $s -lt ${WAIT_S:-250} ] && pgrep -f "[s]glang_soak.py" > /dev/null; do sleep 5; s=$((s + 5)); done
echo "waited $s s $(date +%T)"; tail -c 6000 /tmp/soak10.txt
[ -f /tmp/soak10/soak.json ] && gzip -c /tmp/soak10/soak.json > $OUT/soak10_${TAG:-run4}.json.gz
ls -la /tmp/soak10; (cd /tmp/soak10 && tar czf $OUT/soak10_${TAG:-run4}_logs.tgz *.log) 2>/dev/null; true
