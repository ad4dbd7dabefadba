#!/usr/bin/env bash
# Cold `pytest --cpq-world-size 1` sessions of Megatron-LM's 281 tests on the one-H200 host,
# with pytest's cache on (run.sh turns it off): each session on a broker started just before
# it, with no group, as after the background broker idled out. The first session writes the
# cache's warm-up entry; the later ones ask for that group before their conftests import
# (cpq/client/early_warm.py). Prints each session's wall, its summary and cpq's line on the
# wait for groups. Run from the repo root (the same carried folders as
# megatron_check.sh; it installs the staged wheels and pyzmq itself).
#   MEG_FRESH_XML: a fresh run's JUnit file (run.sh's meg-fresh.xml) to compare verdicts
#   with; without it the script runs the fresh run first and also compares its warnings.
#   MEG_COLD_RUNS: which of the sessions below (default 1 2 3 4).
set -uo pipefail
PROJ=$(pwd); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/cold"
export PYTHONPATH=/tmp/site:/tmp/msite:$PROJ:$PROJ/.megatron/src
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# shellcheck source=tools/gpu/megatron_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/megatron_env.sh"  # FILES, multicast off, no network
M=$PROJ/.megatron
python3 -m pip install -q --no-index --no-deps --target /tmp/msite "$M"/.whl/*.whl >/dev/null 2>&1
PYTHONPATH=/tmp/site python3 -c 'import zmq' 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$PROJ"/.whl/pyzmq-*.whl >/dev/null 2>&1
cd "$M/src" || exit 3
rm -rf .pytest_cache
if [ -z "${MEG_FRESH_XML:-}" ]; then  # no fresh run given: make one (the reference)
  t0=$(date +%s.%N)
  torchrun --standalone --nproc-per-node 1 -m pytest -p no:cacheprovider -p no:cpq -q "${FILES[@]}" \
    --junitxml="$OUT/cold/fresh.xml" > "$OUT/cold/fresh.log" 2>&1
  t1=$(date +%s.%N)
  echo "FRESH: wall $(python3 -c "print(round($t1 - $t0, 1))")s :: $(grep -E '(passed|failed).* in [0-9.]+s' "$OUT/cold/fresh.log" | tail -1)"
  MEG_FRESH_XML=$OUT/cold/fresh.xml
fi
# 1: no cache yet (it writes one); 2, 4: the cache's group asked for early; 3: the cache
# plugin off (nothing asked for early), after the others, so the disk cache is as warm.
for i in ${MEG_COLD_RUNS:-1 2 3 4}; do
  extra=(); [ "$i" = 3 ] && extra=(-p no:cacheprovider)
  export CPQ_STATE_DIR; CPQ_STATE_DIR=$(mktemp -d /tmp/meg-cold.XXXXXX); chmod 700 "$CPQ_STATE_DIR"
  python3 -m cpq broker --gpus auto > "$OUT/cold/broker-$i.out" 2>&1 &
  broker=$!
  for _ in $(seq 1 120); do python3 -m cpq status --json > /dev/null 2>&1 && break; sleep 0.25; done
  t0=$(date +%s.%N)
  python3 -m pytest -p cpq.client.plugin "${extra[@]}" --cpq-world-size 1 -q "${FILES[@]}" \
    --junitxml="$OUT/cold/cold-$i.xml" > "$OUT/cold/cold-$i.log" 2>&1
  t1=$(date +%s.%N)
  echo "COLD $i: wall $(python3 -c "print(round($t1 - $t0, 1))")s ${extra[*]:-cache on} :: \
$(grep -E '(passed|failed).* in [0-9.]+s' "$OUT/cold/cold-$i.log" | tail -1) :: \
$(grep -o -E '[0-9.]+s waiting for groups to start' "$OUT/cold/cold-$i.log" | tail -1)"
  python3 -m cpq stop > /dev/null 2>&1
  timeout 30 tail --pid="$broker" -f /dev/null || kill -9 "$broker"
done
python3 "$PROJ/.megatron/compare.py" "$MEG_FRESH_XML" "$OUT"/cold/cold-*.xml | grep SUMMARY
if [ -f "$OUT/cold/fresh.log" ] && [ -f "$OUT/cold/cold-2.log" ]; then
  python3 "$PROJ/tools/gpu/warnings_diff.py" "$OUT/cold/fresh.log" "$OUT/cold/cold-2.log" | cut -c1-260 | head -12
fi
