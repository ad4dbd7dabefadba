#!/bin/bash
# Submit N shards of a suite and the merge job that waits for them:
#   CPQ_RESULTS=/shared/ci/results tools/ci/slurm/submit.sh 4 tests/ [pytest args...]
# Rerun one shard of the newest run whose results are in $CPQ_RESULTS (same N and pytest
# args) into that run, then merge again (give CPQ_RUN_ID to pick another run):
#   CPQ_RESULTS=/shared/ci/results tools/ci/slurm/submit.sh --shard 2 4 tests/ [pytest args...]
# Prints the jobs' ids and the run id; the merge job's exit status is the verdict
# (see cpq-merge.sbatch), `sbatch --wait` or squeue tells when it is there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage="usage: submit.sh [--shard I] N [pytest args...]"
rerun=""
if [[ "${1:-}" == "--shard" ]]; then
    rerun=${2:?$usage}
    shift 2
fi
shards=${1:?$usage}
shift
: "${CPQ_RESULTS:?set CPQ_RESULTS to a shared directory}"
if ! [[ "$shards" =~ ^[1-9][0-9]*$ ]] || { [[ -n "$rerun" ]] &&
    ! { [[ "$rerun" =~ ^[0-9]+$ ]] && (( rerun < shards )); }; }; then
    echo "$usage (0 <= I < N)" >&2
    exit 4
fi
unset CPQ_SHARD
if [[ -z "$rerun" ]]; then
    array=$(sbatch --parsable --array="0-$((shards - 1))" "$here/cpq-shards.sbatch" "$@")
    array=${array%%;*}
    run_id=${CPQ_RUN_ID:-slurm-$array}
else
    run_id=${CPQ_RUN_ID:-$("${CPQ_PYTHON:-python}" - "$CPQ_RESULTS" "$shards" <<'PY'
import json, pathlib, sys
found = pathlib.Path(sys.argv[1]).glob(f"shard-*-of-{sys.argv[2]}.json")
runs = {}
for path in found:
    data = json.loads(path.read_text())
    run = data.get("run_id", "")
    runs[run] = max(runs.get(run, 0.0), float(data.get("started_at", 0.0)))
if not runs:
    sys.exit(f"submit.sh: no results of {sys.argv[2]} shards in {sys.argv[1]}; set CPQ_RUN_ID")
print(max(runs, key=runs.get))  # the newest run: a cancelled shard may have left an older
PY
)}
    array=$(CPQ_SHARD="$rerun/$shards" CPQ_RUN_ID="$run_id" \
        sbatch --parsable --array="$rerun" "$here/cpq-shards.sbatch" "$@")
    array=${array%%;*}
fi
merge=$(CPQ_RUN_ID="$run_id" sbatch --parsable --dependency=afterany:"$array" \
    "$here/cpq-merge.sbatch")
echo "run: $run_id  shards: $array  merge: $merge"
