#!/usr/bin/env bash
# Issue 34, on the one-H200 host: where a warm `pytest --cpq-world-size 1` session's wall goes,
# and what the calling pytest process alone costs (the floor of any design in which the calling
# process loads the suite's conftests and collects it). One call, from the repo root:
#   1. the calling process alone: `import torch`; the suite's root conftest; `--collect-only`
#      with and without cpq's plugin (no test runs);
#   2. the reference: a fresh `torchrun --standalone --nproc-per-node 1 -m pytest`;
#   3. for each cpq tree in CPQ_TREES (default: this checkout), a broker of its own and
#      `pytest --cpq-world-size 1` three times (cold, warm, warm again); trees side by side in
#      one call (e.g. CPQ_TREES="new=. before=.cpq-before", the earlier commit's cpq/ unpacked
#      there by `git archive`);
#   4. `cpq torchrun --standalone --nproc-per-node 1 -m pytest` twice (a warm launch of the whole
#      session: the suite's own command line, as Megatron's CI runs it);
#   5. compare.py: every JUnit file against the fresh one, test by test.
# Needs (carried, git-ignored): .megatron (shared/megatron/stage.sh's folder) and .whl (pyzmq).
# Knobs: MEG_FILES (the selection, default run.sh's 11 paths); MEG_LAUNCH_ONLY=1 (the fresh
# run and the launches only). Results in $OUT.
set -uo pipefail
PROJ=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
HERE=$PROJ/.megatron
MSITE=/tmp/msite SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --target "$MSITE" "$HERE"/.whl/*.whl >/dev/null 2>&1
python3 -c 'import numpy' 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --target "$MSITE" "$HERE"/.whl/optional/numpy-*.whl >/dev/null 2>&1
PYTHONPATH=$SITE python3 -c 'import zmq' 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --target "$SITE" "$PROJ"/.whl/pyzmq-*.whl >/dev/null 2>&1
export PYTHONPATH=$SITE:$MSITE:$PROJ:$HERE/src
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# shellcheck source=tools/gpu/megatron_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/megatron_env.sh"  # FILES, multicast off, no network
if [ -n "${MEG_FILES:-}" ]; then read -r -a FILES <<< "$MEG_FILES"; fi
cd "$HERE/src" || exit 3
LOG=$OUT/logs
mkdir -p "$LOG"
row() { printf '%-44s %8s  %s\n' "$1" "$2" "$3" | tee -a "$OUT/floor.txt"; }
timed() { # NAME CMD...: wall seconds of CMD, its last summary line
  local name=$1 t0 t1
  shift
  t0=$(date +%s.%N)
  timeout 300 "$@" > "$LOG/$name.log" 2>&1
  local rc=$?
  t1=$(date +%s.%N)
  row "$name" "$(python3 -c "print(f'{$t1 - $t0:.1f}')")" \
    "rc $rc $(grep -E '(passed|failed|error|skipped|collected|tests? ran).* in [0-9.]+s' "$LOG/$name.log" | tail -1)"
}
: > "$OUT/floor.txt"
if [ "${MEG_LAUNCH_ONLY:-0}" = 0 ]; then
  timed import-torch python3 -c 'import torch'
  timed import-conftest python3 -c 'import tests.unit_tests.conftest'
  timed collect-plain python3 -m pytest -p no:cacheprovider -p no:cpq -q --collect-only "${FILES[@]}"
  timed collect-cpq python3 -m pytest -p no:cacheprovider -p cpq.client.plugin --cpq-world-size 1 -q --collect-only "${FILES[@]}"
  python3 -X importtime -c 'import tests.unit_tests.conftest' 2> "$LOG/importtime.txt"
  sort -t'|' -k2 -n -r "$LOG/importtime.txt" | head -12 > "$OUT/importtime-top.txt"
fi

timed fresh torchrun --standalone --nproc-per-node 1 -m pytest -p no:cacheprovider -p no:cpq -q \
  "${FILES[@]}" --junitxml="$OUT/fresh.xml"

LAUNCH=(python3 -m cpq torchrun --standalone --nproc-per-node 1 -m pytest -p no:cacheprovider -p no:cpq -q)
CPQ=(-p no:cacheprovider -p cpq.client.plugin --cpq-world-size 1 -q)
XMLS=()
for entry in ${CPQ_TREES:-new=.}; do
  name=${entry%%=*} tree=$(cd "$PROJ/${entry#*=}" && pwd)
  export PYTHONPATH=$SITE:$MSITE:$tree:$HERE/src CPQ_STATE_DIR
  CPQ_STATE_DIR=$(mktemp -d /tmp/floor-state.XXXXXX)
  chmod 700 "$CPQ_STATE_DIR"
  python3 -m cpq broker --gpus auto --log-dir "$LOG/broker-$name" > "$LOG/broker-$name.out" 2>&1 &
  BROKER=$!
  for _ in $(seq 1 120); do python3 -m cpq status --json >/dev/null 2>&1 && break; sleep 0.5; done
  runs="cold warm warm2"
  [ "${MEG_LAUNCH_ONLY:-0}" = 0 ] || runs=""
  for run in $runs; do
    timed "$name-session-$run" python3 -m pytest "${CPQ[@]}" "${FILES[@]}" --junitxml="$OUT/$name-session-$run.xml"
    XMLS+=("$OUT/$name-session-$run.xml")
  done
  trees=${CPQ_TREES:-new=.}
  if [ "$name" = "${trees%%=*}" ]; then  # the first tree only
    for run in 1 2; do
      timed "$name-launch-$run" "${LAUNCH[@]}" "${FILES[@]}" --junitxml="$OUT/$name-launch-$run.xml"
      XMLS+=("$OUT/$name-launch-$run.xml")
    done
  fi
  python3 -m cpq status > "$LOG/status-$name.txt" 2>&1
  cp "$CPQ_STATE_DIR"/timings.jsonl "$LOG/timings-$name.jsonl" 2>/dev/null
  python3 -m cpq stop > /dev/null 2>&1
  for _ in $(seq 1 60); do kill -0 "$BROKER" 2>/dev/null || break; sleep 0.5; done
  kill -TERM "$BROKER" 2>/dev/null
done
python3 "$HERE/compare.py" "$OUT/fresh.xml" "${XMLS[@]}" --json "$OUT/diff.json" > "$OUT/compare.txt" 2>&1
grep -v -E "^  (DIFF|ONLY)" "$OUT/compare.txt" | head -20; grep -c DIFF "$OUT/compare.txt"
cat "$OUT/floor.txt"
cat "$OUT/importtime-top.txt" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$LOG" . && rm -rf "$LOG"
