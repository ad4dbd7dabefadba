#!/usr/bin/env bash
# Issue 34 on the one-H200 host: the staged Megatron-LM run (.megatron/run.sh: a fresh
# `torchrun -m pytest`, then a cold and a warm `pytest --cpq-world-size 1`) twice in one call,
# without and with the warm caller (CPQ_WARM_CALLER=0, then unset: "auto"), the verdicts of
# each compared test by test with that run's fresh one. Prints one table; the logs, the
# warm caller's log and each run's summary in $OUT. From the repo root; carry .megatron, .whl.
set -uo pipefail
PROJ=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for mode in ${MODES:-off auto}; do
  if [ "$mode" = off ]; then export CPQ_WARM_CALLER=0; else unset CPQ_WARM_CALLER; fi
  # run.sh makes (and at its end removes) its own state directory, where the warm caller
  # logs: copied while it runs.
  ( while sleep 1; do cat /tmp/meg-cpq-state.*/callers/*.log > "$OUT/$mode-warm-caller.log" 2>/dev/null; done ) &
  COPIER=$!
  OUT=$OUT/$mode bash .megatron/run.sh "$PROJ" > "$OUT/$mode.out" 2>&1
  kill $COPIER
  echo "== $mode"; grep -E "wall|differ|fresh|cold|warm" "$OUT/$mode/meg-summary.txt" | head -20
  grep -E "cpq.caller" "$OUT/$mode-warm-caller.log" 2>/dev/null | cut -c1-220 | head -12
done
pkill -f "cpq.caller" 2>/dev/null || true
