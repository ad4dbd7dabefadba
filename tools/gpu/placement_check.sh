#!/usr/bin/env bash
# Issue 29 on the H200 host: one session alternating two ws=1 specs (a pinned variable
# differs) on one GPU, which holds one group at a time. tools/bench_placement.py side by
# side: the fresh torchrun -m pytest per spec, this code (tests grouped by spec), the same
# with --cpq-keep-order, and the code before issue 29 (.bench-before, carried).
# Usage (repo root, on the GPU host, .whl and .bench-before carried):
#   tools/gpu/placement_check.sh [CASES]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
mkdir -p "$OUT"
python3 tools/bench_placement.py --mix 1:a,1:b --cases "${1:-8}" --before .bench-before \
    --json "$OUT/bench_placement_h200.json"
