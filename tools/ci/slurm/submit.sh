#!/bin/bash
# Submit N shards of a suite and the merge job that waits for them:
#   CPQ_RESULTS=/shared/ci/$CI_RUN_ID tools/ci/slurm/submit.sh 4 tests/ [pytest args...]
# Prints the array's and the merge job's ids; `sbatch --wait` on the merge job (or squeue)
# tells when the verdict is there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
shards=${1:?usage: submit.sh N [pytest args...]}
shift
: "${CPQ_RESULTS:?set CPQ_RESULTS to a shared directory}"
array=$(sbatch --parsable --array=0-$((shards - 1)) "$here/cpq-shards.sbatch" "$@")
merge=$(sbatch --parsable --dependency=afterany:"${array%%;*}" "$here/cpq-merge.sbatch")
echo "shards: $array  merge: $merge"
