#!/usr/bin/env bash
# Where a Megatron-LM session's time goes under cpq, on the one-H200 host (from the repo
# root; the same carried folders as megatron_check.sh). Prints:
#   * the client's start: python + pytest + conftest imports, with and without cpq's plugin
#     (--collect-only), and the largest imports (-X importtime);
#   * a cold and a warm cpq session with every rank's task handling under cProfile
#     (CPQ_RANK_PROFILE), then the warm session's top functions by own and cumulative time.
set -uo pipefail
PROJ=$(pwd); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=$PROJ/.megatron
python3 -m pip install -q --no-index --no-deps --target /tmp/msite "$M"/.whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$PROJ"/.whl/pyzmq-*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:/tmp/msite:$PROJ:$M/src
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=${MEG_NO_PYC-1}
# shellcheck source=tools/gpu/megatron_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/megatron_env.sh"  # FILES, multicast off, no network
cd "$M/src" || exit 3
t() { local s; s=$(date +%s.%N); "$@" > /dev/null 2>&1; echo "$(python3 -c "import time;print(round(time.time()-$s,2))")s :: ${*:0:6}"; }
echo "== client start (PYTHONDONTWRITEBYTECODE=$PYTHONDONTWRITEBYTECODE)"
t python3 -c 'import torch'
t python3 -c 'import megatron.core.parallel_state'
t python3 -m pytest -q -p no:cacheprovider -p no:cpq --collect-only "${FILES[@]}"
python3 -X importtime -m pytest -q -p no:cacheprovider -p no:cpq --collect-only "${FILES[@]}" 2> "$OUT/importtime.txt" > /dev/null
sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -12
export CPQ_STATE_DIR; CPQ_STATE_DIR=$(mktemp -d /tmp/prof-state.XXXXXX); chmod 700 "$CPQ_STATE_DIR"
export CPQ_RANK_PROFILE=$OUT/prof CPQ_SPEC_ENV=CPQ_RANK_PROFILE; mkdir -p "$CPQ_RANK_PROFILE"
python3 -m cpq broker --gpus auto --log-dir "$OUT/broker" > "$OUT/broker.out" 2>&1 &
for _ in $(seq 1 120); do python3 -m cpq status --json >/dev/null 2>&1 && break; sleep 0.5; done
ARGS=(-p no:cacheprovider -p cpq.client.plugin --cpq-world-size 1 -q)
t python3 -m pytest "${ARGS[@]}" --collect-only "${FILES[@]}"
for s in cold warm; do
  t python3 -m pytest "${ARGS[@]}" "${FILES[@]}" --junitxml="$OUT/prof-$s.xml"
done
cp "$CPQ_STATE_DIR/timings.jsonl" "$OUT/" 2>/dev/null
python3 -m cpq stop >/dev/null 2>&1
python3 "$PROJ/tools/gpu/task_overhead.py" "$OUT/timings.jsonl" "$OUT/prof-warm.xml"
python3 - "$CPQ_RANK_PROFILE" <<'PY'
import glob, pstats, sys
# the warm session's: tasks 300 on (a file per 25 tasks; the cold session has 281)
files = [f for f in glob.glob(sys.argv[1] + "/*.prof") if int(f[-9:-5]) > 12]
if not files:
    sys.exit("no profile")
st = pstats.Stats(*files)
st.sort_stats("tottime").print_stats(18)
st.sort_stats("cumulative").print_stats(30)
PY
