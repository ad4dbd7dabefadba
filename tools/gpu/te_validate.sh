#!/usr/bin/env bash
# On the H200 pair, after te-stage.sh has copied all five parts (p0..p4) into /tmp/te:
# install TE 2.20.2 and pyzmq into /tmp/site, then validate workers/te_attention.py with
# plain torchrun (no cpq): one full single-case torchrun (end-to-end wall clock), then the
# case matrix in one process group. Logs and JSON go to $OUT (the device tool's folder) or
# /tmp/te-out. Why a script: the device tool takes commands of at most 2000 characters.
#
# Usage (repo root, on the GPU host):  tools/gpu/te_validate.sh [BUDGET_S]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/te-out}
mkdir -p "$out"
budget=${1:-75}
now() { python3 -c 'import time; print(f"{time.time():.3f}")'; }
since() { python3 -c "import sys, time; print(f'{time.time() - float(sys.argv[1]):.1f}')" "$1"; }

t=$(now)
if [ ! -d /tmp/site/transformer_engine ]; then
  "$(dirname "$0")/te-install.sh" 2>&1 | tee "$out/install.log" || exit 1
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
echo "install: $(since "$t") s"
export PYTHONPATH=/tmp/site

nvidia-smi -L
python3 - <<'EOF' 2>&1 | tee "$out/versions.log"
import time
t = time.perf_counter()
import torch
t1 = time.perf_counter()
import transformer_engine.pytorch
t2 = time.perf_counter()
import transformer_engine
import zmq
from transformer_engine.pytorch.utils import get_cudnn_version
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("nccl", torch.cuda.nccl.version(), "cudnn", get_cudnn_version(), "pyzmq", zmq.__version__)
print("transformer_engine", transformer_engine.__version__)
print(f"import torch {t1 - t:.2f} s, import transformer_engine.pytorch {t2 - t1:.2f} s (1 process)")
EOF

run() {  # run NAME TIMEOUT ARGS...: one torchrun of the driver, wall clock measured here
  local name=$1 limit=$2; shift 2
  local t0; t0=$(now)
  TE_STANDALONE_T0=$t0 timeout "$limit" torchrun --standalone --nproc-per-node 2 \
    tools/gpu/te_standalone.py --json "$out/$name.json" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "[$name] torchrun wall: $(since "$t0") s (rc $rc)" | tee -a "$out/$name.log"
}
run single 200 --cases first
run matrix 300 --cases all --budget-s "$budget" --repeat-first
