#!/usr/bin/env bash
# Issue 34's GPU check, on the one-H200 host, in one call (from the repo root):
#   1. Megatron-LM's 281 unit tests: fresh torchrun -m pytest, cpq cold, cpq warm
#      (the staged folder's run.sh; verdicts compared test by test);
#   2. cpq's time per test beyond the test's own (tools/gpu/task_overhead.py), warm session;
#      what the rank imported ahead of the warm session (its log);
#   3. a second Megatron-LM bucket of our choosing (optimizer/ and four top-level files that
#      import without Transformer Engine), the same three runs;
#   4. tools/bench_core.py: the no-op round trip against the stdio pool, side by side;
#   5. tools/boundary_check.py: the session boundary's rows, CUDA ones included;
#   6. tools/bench_torchrun.py: warm launches (a process per launch, the launch relay)
#      against the real torchrun, nccl on the GPU.
# MEG_SECOND=0 / MEG_BENCH=0 / MEG_BOUNDARY=0 / MEG_TORCHRUN=0 skip 3 / 4 / 5 / 6.
# Needs (carried, git-ignored): .megatron (stage.sh's folder, plus the second bucket's files)
# and .whl (the cp312 pyzmq wheel). Results in $OUT (the runs' folders in runs.tgz).
set -uo pipefail
PROJ=$(pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/main" "$OUT/second"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SECOND="tests/unit_tests/optimizer tests/unit_tests/test_hyper_comm_grid.py \
tests/unit_tests/test_process_groups_config.py tests/unit_tests/test_rank_utils.py \
tests/unit_tests/test_optimizer_param_scheduler.py"

OUT=$OUT/main bash .megatron/run.sh "$PROJ"
tar -xzf "$OUT/main/meg-logs.tar.gz" -C "$OUT/main" ./timings.jsonl ./broker 2>/dev/null
echo "== imports ahead of the warm session (rank logs: what was imported ahead, what became of it)"
grep -h -E "imported ahead|modules imported ahead|not importing" "$OUT"/main/broker/*rank*.log \
  2>/dev/null | cut -c1-260 | head -8 | tee "$OUT/ahead.txt"
echo "== cpq's time per test (warm session)" | tee "$OUT/overhead.txt"
python3 tools/gpu/task_overhead.py "$OUT/main/timings.jsonl" "$OUT/main/meg-warm.xml" \
  | tee -a "$OUT/overhead.txt"

if [ "${MEG_SECOND:-1}" != 0 ]; then
  OUT=$OUT/second MEG_FILES=$SECOND bash .megatron/run.sh "$PROJ"
fi

if [ "${MEG_BENCH:-1}" != 0 ]; then
  echo "== bench_core"
  PYTHONPATH=/tmp/site:$PROJ timeout 200 python3 tools/bench_core.py --tasks 1000 \
    --json "$OUT/bench_core.json" 2>&1 | grep -v -E '^\*|OMP_NUM|^$' | tail -22 | tee "$OUT/bench_core.txt"
fi

if [ "${MEG_BOUNDARY:-1}" != 0 ]; then
  echo "== session boundary (fresh torchrun -m pytest per session against cpq sessions)"
  CPQ_STATE_DIR=$(mktemp -d /tmp/boundary-state.XXXXXX)
  chmod 700 "$CPQ_STATE_DIR"
  CPQ_STATE_DIR=$CPQ_STATE_DIR PYTHONPATH=/tmp/site:$PROJ timeout 400 python3 tools/boundary_check.py \
    --json "$OUT/boundary.json" --keep /tmp/boundary | tee "$OUT/boundary.txt"
  grep -h -E "restored torch|unfit|still holds|sticky" "$CPQ_STATE_DIR"/logs/*.log 2>/dev/null | cut -c1-220 | head -8
  CPQ_STATE_DIR=$CPQ_STATE_DIR PYTHONPATH=/tmp/site:$PROJ python3 -m cpq stop > /dev/null 2>&1
fi

if [ "${MEG_TORCHRUN:-1}" != 0 ]; then
  echo "== bench_torchrun (nccl, one GPU)"
  PYTHONPATH=/tmp/site:$PROJ PATH=$PATH timeout 300 python3 tools/bench_torchrun.py \
    --launches 8 --nproc 1 --gpus auto 2>&1 | tail -8 | tee "$OUT/bench_torchrun.txt"
fi

# The device tool brings back at most 8 files from $OUT: the runs' lines once more at the
# end (the call's output tail), their folders in one archive.
echo "== summary"
grep -h -E "^RUN|^SUMMARY|^host:" "$OUT"/main/meg-summary.txt "$OUT"/second/meg-summary.txt 2>/dev/null
(cd "$OUT" && tar -czf runs.tgz main second 2>/dev/null && rm -rf main second)
