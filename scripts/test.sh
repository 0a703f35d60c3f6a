#!/usr/bin/env bash
# The test command (README): sets everything up on a fresh machine, then runs every test that can run without a GPU.
# Step 1: core, simulator, controller, real-model engine (CPU).  Step 2: the wheel, built and used on its own.
# Step 3: SGLang plugin and the real anchors.
# To fit 2 cores, work that waits on the network or the disk runs beside work that computes: the sglang environment
# (.venv-sglang, mostly a download) is built in the background during step 1, and the wheel check (step 2) runs
# beside step 3's tests. Each background job's output is printed, whole, when it is waited for.
# Tests marked `slow` (pyproject.toml: the longer real-model engine runs, a second numba compile) run where CI=true
# (CI runs `bash scripts/test.sh` with CI=true) or with --slow; elsewhere they are deselected, and the last line
# says how many. Usage: scripts/test.sh [--slow]
set -euo pipefail
cd "$(dirname "$0")/.."
slow=0
case "${1:-}" in
  --slow) slow=1 ;;
  "") ;;
  *) echo "usage: $0 [--slow]" >&2; exit 2 ;;
esac
[ "${CI:-}" = true ] && slow=1
select=()
[ "$slow" = 1 ] || select=(-m "not slow")
logs=$(mktemp -d)
deselected=0
run_pytest() {  # run pytest ($1) on the rest of the arguments; add the tests it deselected to $deselected
  local py=$1; shift
  "$py" -m pytest "$@" -q -ra "${select[@]}" | tee "$logs/pytest.txt"
  local n
  n=$(tail -n 1 "$logs/pytest.txt" | grep -o "[0-9]* deselected" | cut -d" " -f1 || true)
  deselected=$((deselected + ${n:-0}))
}

# Background jobs: the name is the log's; `finish NAME` waits for it, prints its log, returns its exit status.
declare -A pids=()
start_bg() { local name=$1; shift; "$@" > "$logs/$name" 2>&1 & pids[$name]=$!; }
finish() {
  local name=$1 status=0
  wait "${pids[$name]}" || status=$?
  unset "pids[$name]"
  cat "$logs/$name"
  return "$status"
}
on_exit() {  # a failure above ends the script: let a background install finish rather than leave it half-built
  local name
  for name in "${!pids[@]}"; do
    echo "(waiting for the background job '$name' to finish)" >&2
    wait "${pids[$name]}" || true
  done
  rm -rf "$logs"
}
trap on_exit EXIT

echo "== step 1: core environment"
bash scripts/setup_env.sh core
# After the core install (both installs build the package's metadata in this folder) and before the wheel build.
echo "== step 3, in the background: the sglang environment (sglang 0.5.23 + arctic-inference), built during step 1"
start_bg sglang-env bash scripts/setup_env.sh sglang
echo "== step 1: lint (ruff, configured in pyproject.toml)"
.venv/bin/ruff check .
echo "== step 1: core, simulator, controller and engine tests"
run_pytest .venv/bin/python tests

echo "== step 3: waiting for the sglang environment; its log:"
status=0
finish sglang-env || status=$?
echo "== step 2, in the background: build the wheel, install it into a fresh venv (numpy and numba only), run it there"
start_bg wheel-check bash scripts/wheel_check.sh .venv/bin/python
if [ "$status" -eq 0 ]; then
  echo "== step 3: SGLang plugin and anchor tests against the real packages"
  run_pytest .venv-sglang/bin/python tests/integration tests/test_simulate_anchors.py
fi
echo "== step 2: the wheel check's log:"
finish wheel-check
if [ "$status" -eq 3 ]; then  # not enough disk for even the cpu flavour: say so, loudly, and stop green
  echo "== step 3 SKIPPED: the sglang environment could not be built on this machine (reason above)."
  echo "   The SGLang plugin and the SGLang/Arctic anchor tests did not run."
elif [ "$status" -ne 0 ]; then
  echo "== step 3: building the sglang environment failed (above)" >&2
  exit "$status"
fi
if [ "$slow" = 1 ]; then
  echo "== done: every test ran, the ones marked slow included"
else
  echo "== done; NOT RUN here: $deselected tests marked slow (CI runs them: CI=true bash scripts/test.sh, or --slow)"
fi
