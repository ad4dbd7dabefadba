#!/usr/bin/env bash
# On the H200 pair: Transformer Engine's own CP test file, its stdio pool vs cpq (issue 15).
# Installs TE + pyzmq into /tmp/site unless done (tools/gpu/final.sh install: needs the five
# staged parts), checks .te-tests/ (carried: it is git-ignored), then runs run_anchor.py
# within the budget. What comes back from $OUT: anchor.log (everything printed),
# te_anchor.json (copy it to tools/results/), te_anchor_logs.tar.gz (pytest, JUnit, broker,
# group and rank logs). Every process keeps NVLink multicast off.
#
# Usage (repo root, on the GPU host):
#   bash tools/gpu/te_anchor/anchor.sh [BUDGET_S] [run_anchor.py args...]   BUDGET_S: def. 560
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 2
start=$(date +%s)
budget=560
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then budget=$1; shift; fi
out=${OUT:-/tmp/te-anchor-out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# NCCL_* and TORCH_* are start variables of a cpq spec already; this makes NVSHMEM_'s one too,
# so cpq's group processes are started with it, not only given it per task.
export CPQ_SPEC_ENV=NVSHMEM_DISABLE_NVLS
export PYTHONUNBUFFERED=1

main() {
  echo "[anchor.sh] $(date -u +%FT%TZ) budget ${budget}s, repo $(pwd), out $out"
  nvidia-smi -L || true
  if [ ! -f /tmp/site/.cpq-te-installed ]; then
    bash tools/gpu/final.sh install || { echo "[anchor.sh] TE install failed"; return 3; }
  fi
  export PYTHONPATH=/tmp/site:$PWD
  bash tools/gpu/te_anchor/fetch_te_tests.sh --check || {
    echo "[anchor.sh] .te-tests/ missing or changed: carry it (fetch_te_tests.sh makes it)"
    return 4
  }
  python3 -c 'import zmq, xdist, transformer_engine, torch; print("[anchor.sh] torch",
    torch.__version__, "TE", transformer_engine.__version__, "gpus", torch.cuda.device_count())' \
    || return 5
  local left=$((budget - ($(date +%s) - start) - 15))
  echo "[anchor.sh] run_anchor.py gets ${left}s"
  python3 tools/gpu/te_anchor/run_anchor.py --budget-s "$left" --json "$out/te_anchor.json" \
    --logs-tar "$out/te_anchor_logs.tar.gz" "$@"
  local rc=$?
  echo "[anchor.sh] done in $(($(date +%s) - start)) s, run_anchor.py rc $rc"
  return $rc
}

main "$@" 2>&1 | tee -a "$out/anchor.log"
exit "${PIPESTATUS[0]}"
