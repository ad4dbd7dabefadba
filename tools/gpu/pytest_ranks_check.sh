#!/usr/bin/env bash
# Issues 27 and 28 on the H200 host, in one device-tool call: what pytest + cpq add per test
# on a warm nccl group now against the tree before the ranks ran pytest
# (tools/bench_pytest_ranks.py), and warm torchrun launches against real ones
# (tools/bench_torchrun.py). The host has no package registry: cpq goes on PYTHONPATH,
# pyzmq comes as a wheel in .whl/, the baseline tree in .bench-baseline/ (both carried).
#
# Here first:  git archive 51d7909 cpq | tar -x -C .bench-baseline   (ignored in git)
# Usage (repo root, on the GPU host):  tools/gpu/pytest_ranks_check.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/pytest-ranks-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L 2>&1 | tee "$out/versions.log"
python3 -c "import torch, pytest, zmq; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'pytest', pytest.__version__, 'pyzmq', zmq.__version__)" 2>&1 | tee -a "$out/versions.log"
ws=$(python3 -c "import torch; print(min(2, torch.cuda.device_count()))")
timeout -k 10 300 python3 tools/bench_pytest_ranks.py --tests 200 --reps 3 --gpus auto --world-size "$ws" \
  --baseline-tree .bench-baseline --json "$out/bench_pytest_ranks.json" 2>&1 | tee "$out/bench_pytest_ranks.log"
timeout -k 10 200 python3 tools/bench_torchrun.py --launches 8 --nproc "$ws" --gpus auto 2>&1 \
  | tee "$out/bench_torchrun.log"
left=$(pgrep -f "cpq.rank|cpq.broker" || true)
[ -n "$left" ] && echo "leftover processes: $left"
exit 0
