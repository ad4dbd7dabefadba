#!/usr/bin/env bash
# The context-parallel attention benchmark (tools/bench_cp.py --gpu) on the H200 host, in one
# device-tool call of under 8 minutes: GPU_CASES with nccl; cpq one session (3) against
# pytest -n 2 (4) at ws=2 and at ws=1 (two GPUs: one group per xdist worker), then the stdio
# pool (2) at both sizes, the stdio pool under pytest (2p), torchrun per case on K=3 cases
# (1) and the early warm-up experiment (3e) at ws=2.
#
# Why a script: the device tool takes commands of at most 2000 characters, the host has no
# package registry (so cpq is not pip-installed: the repo root goes on PYTHONPATH and the
# bench starts everything with `python3 -m ...`, never console scripts), and only what lands
# in $OUT comes back. pyzmq is the one dependency the host lacks: carry its wheel in .whl/.
#
# Usage (repo root, on the GPU host; the device tool's `carry` must include .whl):
#   tools/gpu/run_cp_bench.sh [extra bench_cp.py args, e.g. --spawn-cases 2]
# Comes back in $OUT: bench_cp_gpu.json (copy to tools/results/), BENCHMARKS_gpu.md (the
# section to paste into BENCHMARKS.md), bench_cp_gpu.log, versions.log, logs/ (pytest,
# broker and rank logs).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/cp-bench-out}
mkdir -p "$out/logs"
limit=${BENCH_TIMEOUT_S:-450}  # the bench itself; install and checks take a few seconds more

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD

nvidia-smi -L 2>&1 | tee "$out/versions.log"
python3 - <<'EOF' 2>&1 | tee -a "$out/versions.log"
import sys

import msgpack, psutil, pytest, torch, xdist, zmq

nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), "nccl", nccl)
print("pyzmq", zmq.__version__, "msgpack", msgpack.version, "psutil", psutil.__version__,
      "pytest", pytest.__version__, "xdist", xdist.__version__)
import cpq, cpq.client.plugin  # noqa: E401 - from the repo, through PYTHONPATH
print("cpq", cpq.__file__)
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "run_cp_bench: environment check failed"; exit 1; }

# --budget-s makes the bench stop starting modes in time to write its table; timeout is the
# backstop. Modes run in priority order: (3) and (4) at ws=2 and ws=1 first, extras after.
timeout -k 10 "$limit" python3 tools/bench_cp.py --gpu --budget-s $((limit - 30)) \
  --json "$out/bench_cp_gpu.json" --markdown "$out/BENCHMARKS_gpu.md" --log-dir "$out/logs" \
  "$@" 2>&1 | tee "$out/bench_cp_gpu.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 124 ] && echo "run_cp_bench: bench cut at ${limit}s; the JSON holds the modes that finished"
# Nothing the bench started may outlive it (brokers stop their groups; this is the check).
left=$(pgrep -f "cpq.rank|stdio_pool.py --worker|bench_cp.py --one-case" || true)
[ -n "$left" ] && echo "run_cp_bench: leftover processes: $left" | tee -a "$out/bench_cp_gpu.log"
exit "$rc"
