#!/usr/bin/env bash
# Megatron-LM's own unit tests on this CPU machine, fresh against cpq (issue 34): the staged
# subset (.megatron, see ../shared/megatron/README.md) imports torch and megatron.core as on the
# GPU host, so the warm caller's blame, its hand-over and the verdicts can be checked here.
# Megatron needs CUDA for most of these tests and Python 3.12: on CPU many fail in every run
# (the comparison is verdict equality, test by test), and `typing.override` is shimmed.
#
#   bash tools/megatron_cpu.sh            # from the repository root, .megatron staged
#
# Runs: a fresh `torchrun --standalone --nproc-per-node 1 -m pytest`; then a private broker and
# `pytest --cpq-world-size 1` cold, handed to the warm caller, with CPQ_WARM_CALLER=0, and
# handed over again. Prints each run's wall and summary, the verdicts that differ from the
# fresh run's, and the warm caller's findings. MEG_FILES replaces the selection.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC=$ROOT/.megatron/src
[ -d "$SRC/megatron" ] || { echo "no staged Megatron-LM in $SRC (shared/megatron/stage.sh)"; exit 2; }
SITE=${MEG_CPU_SITE:-/tmp/megatron-cpu-site}
if ! PYTHONPATH=$SITE python -c 'import triton, einops' 2>/dev/null; then
    python -m pip install -q --target "$SITE" triton einops > /dev/null
fi
cat > "$SITE/sitecustomize.py" <<'PY'
import typing
if not hasattr(typing, "override"):  # Megatron-LM needs 3.12's typing.override
    typing.override = lambda f: f
PY
exec 10>&- 251>&- 2>/dev/null  # descriptors some harnesses leave open
exec 2>&1
cd "$SRC" || exit 2
export PYTHONPATH=$SITE:$ROOT:$SRC
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# its conftest downloads a data set at session start: fail at once, in every run alike
export HTTPS_PROXY=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 \
    https_proxy=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9
CPQ_STATE_DIR=$(mktemp -d /tmp/megatron-cpu-state.XXXXXX)
export CPQ_STATE_DIR
chmod 700 "$CPQ_STATE_DIR"
read -r -a FILES <<< "${MEG_FILES:-tests/unit_tests/test_parallel_state.py tests/unit_tests/transformer/test_rope.py}"
COMMON=(-p no:cacheprovider -p no:randomly -p no:flaky -p no:hypothesispytest -q -rfE)

run() {
    local name=$1 t0 t1
    shift
    t0=$(date +%s.%N)
    timeout 600 "$@" > "$CPQ_STATE_DIR/$name.log" 2>&1
    t1=$(date +%s.%N)
    echo "$name: $(python -c "print(round($t1 - $t0, 1))") s :: $(grep -E '(passed|failed).* in ' "$CPQ_STATE_DIR/$name.log" | tail -1)"
}

run fresh python -m torch.distributed.run --standalone --nproc-per-node 1 -m pytest -p no:cpq "${COMMON[@]}" "${FILES[@]}"
python -m cpq broker --gpus none --log-dir "$CPQ_STATE_DIR/broker" > "$CPQ_STATE_DIR/broker.out" 2>&1 &
BROKER=$!
for _ in $(seq 1 60); do python -m cpq status --json > /dev/null 2>&1 && break; sleep 0.5; done
run cold python -m pytest "${COMMON[@]}" --cpq-world-size 1 "${FILES[@]}"
# the warm caller the cold session started: until it serves (its log says so), at most 120 s
for _ in $(seq 1 240); do grep -qs " serving " "$CPQ_STATE_DIR"/callers/*.log && break; sleep 0.5; done
run handed python -m pytest "${COMMON[@]}" --cpq-world-size 1 "${FILES[@]}"
CPQ_WARM_CALLER=0 run off python -m pytest "${COMMON[@]}" --cpq-world-size 1 "${FILES[@]}"
run handed_again python -m pytest "${COMMON[@]}" --cpq-world-size 1 "${FILES[@]}"
python - "$CPQ_STATE_DIR" <<'PY'
import re, sys
state = sys.argv[1]
def verdicts(name):
    found = {}
    for line in open(f"{state}/{name}.log", errors="replace"):
        match = re.match(r"(FAILED|ERROR) (\S+)", line)
        if match:
            found[match[2]] = match[1]
    return found
fresh = verdicts("fresh")
for name in ("cold", "handed", "off", "handed_again"):
    got = verdicts(name)
    differ = sorted(k for k in fresh.keys() | got.keys() if fresh.get(k) != got.get(k))
    print(f"{name}: {len(differ)} verdicts differ from the fresh run's", differ[:5])
PY
grep -hE "leaving out|session [0-9]+ started|refused" "$CPQ_STATE_DIR"/callers/*.log | cut -c1-240
python -m cpq stop > /dev/null
for _ in $(seq 1 60); do kill -0 "$BROKER" 2> /dev/null || break; sleep 0.5; done
echo "logs: $CPQ_STATE_DIR"
