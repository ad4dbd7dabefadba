#!/bin/bash
# cpq CI fan-out on Kubernetes as one CI step: start the Indexed Job of cpq-shards-job.yaml,
# wait until it has completed or failed, run the merge for this Job's run on the results
# volume, print its summary and where the JUnit file is, and exit with the merge's status:
# 0 passed, 1 a test failed, 2 incomplete (a shard failed for good or left no result), 3 no
# verdict (the merge could not run or was killed), 4 bad input. See docs/fanout.md.
#
#   CPQ_IMAGE=your-registry/your-test-image:latest tools/ci/k8s/run.sh
#
# Environment: CPQ_IMAGE (required: the test image, as in the Job), CPQ_K8S_JOB (the Job
# manifest, default cpq-shards-job.yaml beside this script), CPQ_POLL_S (seconds between
# looks at the Job, default 10), and kubectl's own (KUBECONFIG, the namespace of the
# context). The shards' Job is replaced if one of that name exists; the merge is a Job of
# its own (cpq-merge-<uid>), whose exit status and log are read back from its pod.
set -euo pipefail
trap 'echo "run.sh: line $LINENO failed: no verdict (exit 3)" >&2; exit 3' ERR
here=$(cd "$(dirname "$0")" && pwd)
job_file=${CPQ_K8S_JOB:-$here/cpq-shards-job.yaml}
poll=${CPQ_POLL_S:-10}
if [[ -z "${CPQ_IMAGE:-}" ]]; then
    echo "run.sh: set CPQ_IMAGE to the test image the Job runs" >&2
    exit 4
fi
finished() {  # "Complete" or "Failed" once the Job $1 has ended, else nothing
    kubectl get job "$1" -o jsonpath='{.status.conditions[?(@.status=="True")].type}' |
        grep -Eo 'Complete|Failed' | head -n1 || true
}
kubectl delete job cpq-shards --ignore-not-found --wait=true >/dev/null
kubectl apply -f "$job_file" >/dev/null
run_id=$(kubectl get job cpq-shards -o jsonpath='{.metadata.uid}')  # the shards' CPQ_RUN_ID
echo "run: $run_id  shards: job/cpq-shards"
until [[ -n "$(finished cpq-shards)" ]]; do sleep "$poll"; done
echo "shards: $(finished cpq-shards)"

merge=cpq-merge-${run_id:0:8}
kubectl apply -f - >/dev/null <<YAML
apiVersion: batch/v1
kind: Job
metadata: {name: $merge}
spec:
  backoffLimit: 0
  template:
    spec:
      restartPolicy: Never
      containers:
        - name: merge
          image: $CPQ_IMAGE
          command: [python, -m, cpq, merge, --junit, /results/junit.xml,
                    --durations, /results/durations.json, --run-id, "$run_id", /results]
          volumeMounts: [{name: results, mountPath: /results}]
      volumes: [{name: results, persistentVolumeClaim: {claimName: cpq-results}}]
YAML
until [[ -n "$(finished "$merge")" ]]; do sleep "$poll"; done
kubectl logs "job/$merge" || true
status=$(kubectl get pods -l "job-name=$merge" \
    -o jsonpath='{.items[0].status.containerStatuses[0].state.terminated.exitCode}' || true)
kubectl delete job "$merge" --wait=false >/dev/null || true
if ! [[ "$status" =~ ^[0-4]$ ]]; then
    echo "run.sh: the merge of run $run_id gave no verdict (exit 3)" >&2
    exit 3
fi
case $status in
    0 | 1) echo "run $run_id: exit $status; JUnit: junit.xml on the cpq-results volume" ;;
    *) echo "run $run_id: exit $status; no JUnit written (no verdict on the whole suite)" ;;
esac
exit "$status"
