#!/usr/bin/env bash
# The README's main job: a broker with warm groups serving a real distributed suite.
# nccl on the GPUs the broker sees; gloo on the CPU when there are none.
#   1. start cpq-broker (its own state dir, so it never meets another user's broker)
#   2. `cpq submit` the collective checks to a warm ws=2 group
#   3. run the context-parallel attention suite (27 marker tests) on the same warm group
#   4. show cpq-status, then stop the broker
set -euo pipefail
cd "$(dirname "$0")/.."
made_state=""  # a state folder this script made is removed at the end (kept if the job failed)
if [ -z "${CPQ_STATE_DIR:-}" ]; then
    CPQ_STATE_DIR=$(mktemp -d /tmp/cpq-main-XXXXXX)
    made_state=$CPQ_STATE_DIR
fi
export CPQ_STATE_DIR
chmod 700 "$CPQ_STATE_DIR"
export CPQ_ENDPOINT="ipc://$CPQ_STATE_DIR/broker.sock"

cpq-broker --idle-exit 300 >"$CPQ_STATE_DIR/broker.out" 2>&1 &
broker=$!
cleanup() {
    local status=$?
    cpq stop >/dev/null 2>&1 || kill "$broker" 2>/dev/null || true
    wait "$broker" 2>/dev/null || true
    if [ -n "$made_state" ]; then
        if [ "$status" -eq 0 ]; then
            rm -rf "$made_state"
        else
            echo "main_job: failed; the broker's log is in $made_state/broker.out" >&2
        fi
    fi
}
trap cleanup EXIT

echo "== cpq submit --world-size 2 workers.collectives:all_checks"
cpq submit --no-autostart --world-size 2 workers.collectives:all_checks
echo
echo "== pytest tests/test_cp_attention.py (on the same warm group)"
# --noconftest: the suite's conftest starts a private broker for the test suite itself
python -m pytest -q -p no:cacheprovider --noconftest tests/test_cp_attention.py
echo
echo "== cpq-status"
cpq-status
