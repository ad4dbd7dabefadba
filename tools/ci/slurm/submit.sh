#!/bin/bash
# Submit N shards of a suite and the merge job that waits for them:
#   CPQ_RESULTS=/shared/ci/results tools/ci/slurm/submit.sh 4 tests/ [pytest args...]
# Wait for the verdict (a CI step): print the merged summary and where the JUnit file is, and
# exit with the merge's status: 0 passed, 1 a test failed, 2 incomplete (a shard cancelled,
# lost or stale), 3 no verdict (cpq could not run, the merge was killed), 4 bad input:
#   CPQ_RESULTS=/shared/ci/results tools/ci/slurm/submit.sh --wait 4 tests/
# Rerun one shard of the newest run whose results are in $CPQ_RESULTS (same N and pytest
# args) into that run, then merge again (give CPQ_RUN_ID to pick another run):
#   CPQ_RESULTS=/shared/ci/results tools/ci/slurm/submit.sh --shard 2 4 tests/ [pytest args...]
# Cluster options (partition, time limit, account, ...), as sbatch --name=value options
# before N, go to both jobs; or set them in the environment (split on spaces):
#   CPQ_SBATCH_ARGS        both jobs, e.g. "--partition=gpu --account=proj --time=2:00:00"
#   CPQ_SHARD_SBATCH_ARGS  the shards only, e.g. "--gpus-per-node=8"
#   CPQ_MERGE_SBATCH_ARGS  the merge only, e.g. "--partition=cpu --time=10"
#   tools/ci/slurm/submit.sh --wait --partition=gpu --time=60 4 tests/
# The jobs' output files go to the run's logs, ${CPQ_LOGS:-$CPQ_RESULTS/logs}/<run id>/
# (cpq-shard-<array>_<task>.out, cpq-merge-<job>.out), beside the shards' broker and rank
# logs; the merge job leaves its exit status there too (cpq-merge-<job>.status), which is
# what --wait reads: it needs no Slurm accounting. SBATCH_WAIT=1 means --wait.
# --wait looks at the queue soon after submitting (0.1 s, then 0.2, 0.5) and then every
# CPQ_POLL_S seconds (default 1). Usage errors are exit 4: an option before N that is neither
# submit.sh's (--wait, --shard I) nor sbatch's (a pytest option: those go after N) among them.
# Prints the run id, the jobs' ids and the logs directory. See docs/fanout.md, "Slurm".
set -euo pipefail
trap 'echo "submit.sh: line $LINENO failed: no verdict (exit 3)" >&2; exit 3' ERR
here=$(cd "$(dirname "$0")" && pwd)
usage="usage: submit.sh [--wait] [--shard I] [--SBATCH-OPTION=VALUE...] N [pytest args...]"
refuse() {  # an option before N that is not ours nor sbatch's: say so, then the usage
    echo "submit.sh: $1 (before N) is not an option of submit.sh (--wait, --shard I) nor" \
        "an sbatch --name=value option; pytest's options go after N" >&2
    echo "$usage" >&2
    exit 4
}
sbatch_names=""
known_to_sbatch() {  # is --name one of sbatch's options (as its --help lists them)?
    if [[ -z "$sbatch_names" ]]; then
        sbatch_names=$(sbatch --help 2>/dev/null | grep -oE -- '--[a-z][a-z0-9-]*' | sort -u) ||
            sbatch_names="?"
    fi
    [[ "$sbatch_names" == "?" ]] || grep -qxF -- "$1" <<<"$sbatch_names"
}
wait=${SBATCH_WAIT:+yes}
unset SBATCH_WAIT CPQ_SHARD  # sbatch must not block on the array: the wait is ours
rerun=""
asked_rerun=""
cluster=()
read -ra common <<<"${CPQ_SBATCH_ARGS:-}"
read -ra shard_opts <<<"${CPQ_SHARD_SBATCH_ARGS:-}"
read -ra merge_opts <<<"${CPQ_MERGE_SBATCH_ARGS:-}"
while [[ "${1:-}" == -* ]]; do
    case $1 in
        --wait) wait=yes ;;
        --shard)
            [[ $# -ge 2 ]] || { echo "$usage" >&2 && exit 4; }
            rerun=$2 asked_rerun=yes
            shift
            ;;
        --cpq-*) refuse "$1" ;;  # cpq's pytest options: never sbatch's
        --?*=*)
            known_to_sbatch "${1%%=*}" || refuse "$1"
            cluster+=("$1")
            ;;
        *) refuse "$1" ;;
    esac
    shift
done
shards=${1:-}
[[ $# -gt 0 ]] && shift
if [[ -z "${CPQ_RESULTS:-}" ]]; then
    echo "submit.sh: set CPQ_RESULTS to a directory every node can write" >&2
    exit 4
fi
max_poll=${CPQ_POLL_S:-1}
if ! [[ "$max_poll" =~ ^[0-9]*[.]?[0-9]+$ ]]; then
    echo "submit.sh: CPQ_POLL_S=$max_poll is not a number of seconds" >&2
    exit 4
fi
if ! [[ "$shards" =~ ^[1-9][0-9]*$ ]] || { [[ -n "$asked_rerun" ]] &&
    ! { [[ "$rerun" =~ ^[0-9]+$ ]] && (( rerun < shards )); }; }; then
    echo "$usage (0 <= I < N)" >&2
    exit 4
fi
# Absolute: the jobs run in CPQ_WORKDIR, which need not be here.
[[ "$CPQ_RESULTS" == /* ]] || CPQ_RESULTS=$PWD/$CPQ_RESULTS
logs_root=${CPQ_LOGS:-$CPQ_RESULTS/logs}
[[ "$logs_root" == /* ]] || logs_root=$PWD/$logs_root
export CPQ_RESULTS CPQ_LOGS=$logs_root
mkdir -p "$CPQ_RESULTS"
sbatch_shards() {  # sbatch the shards' array with the cluster's options; prints its id
    local id
    id=$(sbatch --parsable "$@" "${common[@]}" "${cluster[@]}" "${shard_opts[@]}" \
        "$here/cpq-shards.sbatch" "${pytest_args[@]}")
    echo "${id%%;*}"
}
pytest_args=("$@")
if [[ -z "$rerun" && -z "${CPQ_RUN_ID:-}" ]]; then
    # The run id is the array's job id: held until its output directory exists.
    array=$(sbatch_shards --hold --array="0-$((shards - 1))" \
        --output="$logs_root/slurm-%A/cpq-shard-%A_%a.out")
    run_id=slurm-$array
    mkdir -p "$logs_root/$run_id"
    scontrol release "$array"
elif [[ -z "$rerun" ]]; then
    run_id=$CPQ_RUN_ID
    mkdir -p "$logs_root/$run_id"
    array=$(sbatch_shards --array="0-$((shards - 1))" \
        --output="$logs_root/$run_id/cpq-shard-%A_%a.out")
else
    run_id=${CPQ_RUN_ID:-}
    if [[ -z "$run_id" ]]; then
        run_id=$("${CPQ_PYTHON:-python}" - "$CPQ_RESULTS" "$shards" <<'PY'
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
) || exit 4
    fi
    mkdir -p "$logs_root/$run_id"
    array=$(CPQ_SHARD="$rerun/$shards" CPQ_RUN_ID="$run_id" sbatch_shards --array="$rerun" \
        --output="$logs_root/$run_id/cpq-shard-%A_%a.out")
fi
logs=$logs_root/$run_id
merge=$(CPQ_RUN_ID="$run_id" sbatch --parsable --dependency=afterany:"$array" \
    --output="$logs/cpq-merge-%j.out" "${common[@]}" "${cluster[@]}" "${merge_opts[@]}" \
    "$here/cpq-merge.sbatch")
merge=${merge%%;*}
echo "run: $run_id  shards: $array  merge: $merge  logs: $logs"
[[ -n "$wait" ]] || exit 0

# --wait: until the merge job has left its status (it runs after every shard has ended).
status_file=$logs/cpq-merge-$merge.status
seen="" gone=0 gone_at=0 round=0
alive='^(PENDING|RUNNING|CONFIGURING|COMPLETING|SUSPENDED|REQUEUE)'
while [[ ! -s "$status_file" ]]; do
    now=$(squeue -h -r -j "$array,$merge" -o '%i %T' 2>/dev/null | awk -v m="$merge" \
        '{printf "%s%s %s", (NR > 1 ? ", " : ""), ($1 == m ? "merge" : "shard " $1), $2}') ||
        now=""
    if [[ -n "$now" && "$now" != "$seen" ]]; then
        echo "waiting for run $run_id: $now"
        seen=$now
    fi
    if squeue -h -j "$merge" -o %T 2>/dev/null | grep -Eq "$alive"; then
        gone=0
    else  # ended (or forgotten) without its status for 3 looks and 2 s: no verdict
        (( gone++ == 0 )) && gone_at=$SECONDS
        (( gone > 3 && SECONDS - gone_at >= 2 )) && break
    fi
    # Short looks first (a quick run's verdict comes at once), then every CPQ_POLL_S s.
    sleep "$(awk -v n="$round" -v m="$max_poll" \
        'BEGIN { p = (n < 3 ? (n == 2 ? 0.5 : 0.1 * (n + 1)) : m); print (p < m ? p : m) }')"
    round=$((round + 1))
done
out=$logs/cpq-merge-$merge.out
[[ -f "$out" ]] && cat "$out"
status=$(cat "$status_file" 2>/dev/null || true)
if ! [[ "$status" =~ ^[0-4]$ ]]; then
    echo "submit.sh: merge job $merge of run $run_id ended without a verdict (exit 3);" \
        "its output: $out" >&2
    exit 3
fi
case $status in
    0 | 1) echo "run $run_id: exit $status; JUnit: $CPQ_RESULTS/junit.xml; logs: $logs" ;;
    *)
        if [[ -f "$CPQ_RESULTS/junit.xml" ]]; then  # the merge removes another run's
            echo "run $run_id: exit $status; no JUnit written (no verdict on the whole" \
                "suite); $CPQ_RESULTS/junit.xml is this run's earlier complete merge's;" \
                "logs: $logs"
        else
            echo "run $run_id: exit $status; no JUnit written (no verdict on the whole" \
                "suite); logs: $logs"
        fi
        ;;
esac
exit "$status"
