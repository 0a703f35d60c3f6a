#!/usr/bin/env bash
# The package stands alone: build the sdist and wheel with `python -m build` into a temp dir, install the wheel
# into a fresh venv with its own dependencies only (numpy, numba), and use it there, outside the repository:
# `ngramspec --version`, `ngramspec profiles`, `ngramspec simulate` on a tiny trace written here, and the SGLang
# plugin's entry point declared in the installed metadata. Usage: scripts/wheel_check.sh [PYTHON-WITH-build]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_PY=${1:-.venv/bin/python}
export PIP_DISABLE_PIP_VERSION_CHECK=1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$BUILD_PY" -m build --outdir "$tmp/dist" . > "$tmp/build.log" 2>&1 || { tail -n 30 "$tmp/build.log"; exit 1; }
wheel=$(ls "$tmp"/dist/ngramspec-*.whl)
echo "built $(basename "$wheel") and $(basename "$(ls "$tmp"/dist/ngramspec-*.tar.gz)")"
unset PYTHONPATH  # from here on, only what the fresh venv holds
"${PYTHON:-python3}" -m venv "$tmp/venv"
"$tmp/venv/bin/pip" install -q "$wheel" 2>&1 | { grep -v "^WARNING: Location" || true; }
echo "installed into a fresh venv: $("$tmp/venv/bin/pip" list --format=freeze | grep -v -e "^pip=" -e "^setuptools=" | tr '\n' ' ')"
cd "$tmp"  # nothing of the repository is importable from here
"$tmp/venv/bin/python" - <<'PY'
import gzip, json, random
random.seed(0)
phrase = [random.randrange(1000) for _ in range(40)]
with gzip.open("tiny.jsonl.gz", "wt") as fh:
    for i in range(6):
        prompt = phrase + [random.randrange(1000) for _ in range(30)] + phrase[:10]  # the phrase, then its start
        fh.write(json.dumps({"id": i, "prompt": prompt, "output": phrase[10:] + [i]}) + "\n")
with open("tiny_text.jsonl", "w") as fh:  # a text log needs --tokenizer: the error must say so, in one line
    fh.write(json.dumps({"prompt": "hello", "output": "world"}) + "\n")
PY
ngs="$tmp/venv/bin/ngramspec"
"$ngs" --version
"$ngs" profiles > profiles.txt && grep -q "^h200-llama8b:" profiles.txt && grep -q "^seed-pcie8:" profiles.txt
"$ngs" simulate tiny.jsonl.gz --profile h200-llama8b --no-progress | tee answer.txt
grep -q "NGRAM_ADAPTIVE" answer.txt
"$ngs" simulate tiny.jsonl.gz --method prompt-lookup:k=8 --profile seed-pcie8 --no-progress --json rows.json > /dev/null
"$tmp/venv/bin/python" -c "
import json; rows = json.load(open('rows.json')); assert rows and rows[0]['speedup'] > 1, rows"
if "$ngs" simulate tiny_text.jsonl --method none --profile seed-pcie8 2> err.txt; then
  echo "a text trace without --tokenizer should fail" >&2; exit 1
fi
[ "$(wc -l < err.txt)" -eq 1 ] && grep -q tokenizer err.txt || { cat err.txt >&2; exit 1; }
# optional packages absent here (torch for the demo, matplotlib for plots): one line each, no traceback
for cmd in "demo" "simulate tiny.jsonl.gz --method none --profile seed-pcie8 --no-progress --plot p.png"; do
  if $ngs $cmd > /dev/null 2> err.txt; then echo "ngramspec $cmd should fail without its optional package" >&2; exit 1; fi
  [ "$(wc -l < err.txt)" -eq 1 ] && grep -q "pip install" err.txt || { cat err.txt >&2; exit 1; }
  cat err.txt
done
"$tmp/venv/bin/python" - <<'PY'
from importlib.metadata import entry_points
import ngramspec, ngramspec_sglang
assert "site-packages" in ngramspec.__file__, ngramspec.__file__
eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value == "ngramspec_sglang:register"]
assert eps, "the sglang.srt.plugins entry point is not declared"
assert eps[0].load() is ngramspec_sglang.register
print(f"entry point sglang.srt.plugins: {eps[0].name} = {eps[0].value} (loads)")
PY
echo "wheel check passed"
