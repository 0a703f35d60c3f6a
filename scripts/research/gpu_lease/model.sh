# sourced: the kit's environment (.kitdev, from make_kitdev.sh) and SmolLM2 as a float16 HF folder in /root/m/smollm2,
# built once per warm machine from /root/m/part00 (carried .carry/p1 in an earlier call) and .carry/p2/part01
source .kitdev/device/env.sh > /tmp/env.txt 2>&1 || { cat /tmp/env.txt; exit 4; }
# the kit's cutlass shim from a copy under $HOME: a later call that does not carry .kitdev removes it from the
# checkout, and a server started here spawns Python processes that must still find it
mkdir -p "$GPUKIT_RUN/stub" && cp .kitdev/device/stub/sitecustomize.py "$GPUKIT_RUN/stub/"
export PYTHONPATH="${PYTHONPATH/$PWD\/.kitdev\/device\/stub/$GPUKIT_RUN/stub}:/root/site"
case ":$PYTHONPATH:" in *":$GPUKIT_RUN/stub:"*) ;; *) echo "model.sh: the shim's path not found in $PYTHONPATH" >&2; exit 7;; esac
if [ ! -f /root/m/smollm2/config.json ]; then
  cat /root/m/part00 .carry/p2/part01 > /root/m/model.gguf || exit 5
  python3 .kitdev/device/gguf_to_hf.py /root/m/model.gguf /root/m/smollm2 --dtype float16 > /tmp/conv.txt 2>&1 \
    || { tail -20 /tmp/conv.txt; exit 6; }
fi
echo "model ready $(date +%T)"
# kills what the bench left (every process whose command line holds "sglang") but this shell and its ancestors: a
# call whose own command names an sglang script (e.g. sglang_gpu_runs.sh) would otherwise kill itself, rc -1
cleanup() {
  local keep=" $$ " p=$$
  while [ "$p" -gt 1 ]; do p=$(ps -o ppid= -p "$p" | tr -d ' '); [ -n "$p" ] || break; keep="$keep$p "; done
  for p in $(pgrep -f sglang); do case "$keep" in *" $p "*) ;; *) kill -9 "$p" 2>/dev/null;; esac; done; true
}
