#!/usr/bin/env bash
# Where a handed-over (warm) session's wall goes, on the one-GPU host: one broker, a cold
# `pytest --cpq-world-size 1` session over the staged Megatron-LM subset, then WARM_RUNS (3)
# warm ones, every pytest process with the hook-time probe (tools/gpu/hooktime.py). Prints
# each session's wall and its steps (tools/gpu/wall_steps.py: seconds from the calling
# process's creation); the probe's log, the warm caller's log and the broker's logs go to
# $OUT. No fresh run here: the warm ÷ fresh ratio is megatron_check.sh's. From the repo
# root; carry .megatron and .whl. On the CPU VM: MSITE=/tmp/megatron-cpu-site (where
# tools/megatron_cpu.sh put triton and its shim) and a /tmp/site holding that sitecustomize.
set -uo pipefail
PROJ=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/site} MSITE=${MSITE:-/tmp/msite}
python3 -m pip install -q --no-index --no-deps --target "$MSITE" .megatron/.whl/*.whl > /dev/null 2>&1
PYTHONPATH=$SITE python3 -c 'import zmq' 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/pyzmq-*.whl > /dev/null 2>&1
cp tools/gpu/hooktime.py "$SITE/"
export PYTHONPATH=$SITE:$MSITE:$PROJ:$PROJ/.megatron/src
# shellcheck source=tools/gpu/megatron_env.sh
source "$PROJ/tools/gpu/megatron_env.sh"  # the 281 tests' paths (FILES), multicast off, no network
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HOOKTIME_LOG=$OUT/ht.log PYTEST_ADDOPTS="-p hooktime"
export CPQ_STATE_DIR
CPQ_STATE_DIR=$(mktemp -d /tmp/wall-state.XXXXXX)
chmod 700 "$CPQ_STATE_DIR"
cd .megatron/src || exit 3
python3 -m cpq broker --gpus auto --log-dir "$OUT/broker" > "$OUT/broker.out" 2>&1 &
for _ in $(seq 1 120); do python3 -m cpq status --json > /dev/null 2>&1 && break; sleep 0.5; done
# cpq's plugin by name where cpq is only on the path (the GPU host); where it is installed its
# entry point loads it (naming it too would register it twice)
PLUGIN=(-p cpq.client.plugin)
python3 -c 'import importlib.metadata as m, sys; sys.exit(not any(e.value.startswith("cpq.") for e in m.entry_points(group="pytest11")))' && PLUGIN=()
for i in cold $(seq 1 "${WARM_RUNS:-3}"); do
  echo "=== session $i" >> "$HOOKTIME_LOG"
  t0=$(date +%s.%N)
  python3 -m pytest -p no:cacheprovider "${PLUGIN[@]}" --cpq-world-size 1 -q "${FILES[@]}" \
    > "$OUT/session-$i.log" 2>&1
  t1=$(date +%s.%N)
  echo "session $i: wall $(python3 -c "print(round($t1 - $t0, 2))") s :: $(tail -1 "$OUT/session-$i.log")"
  echo "=== wall $t0 $t1" >> "$HOOKTIME_LOG"
  sleep "${PAUSE:-6}"  # a pause as between a developer's runs: the next prepared session gets ready
done
cp -r "$CPQ_STATE_DIR/callers" "$OUT/" 2>/dev/null
python3 -m cpq stop > /dev/null 2>&1
grep -h "cpq.caller" "$OUT"/callers/*.log | grep -E "started|refus|ready|ended" | cut -c1-140
python3 "$PROJ/tools/gpu/wall_steps.py" "$HOOKTIME_LOG"
