#!/usr/bin/env bash
# The no-op round trip of two cpq trees side by side on the device host, alternated, each
# run with its own stdio pool (tools/bench_core.py): this checkout ("new") against a base
# tree unpacked from $BASE_TGZ ("base", made here with
# `git archive BASE cpq tools workers | gzip > .bench-base.tgz`; git-ignored, carried).
# SPINS: the CPQ_SPIN_US values the new tree runs with, each a run of its own per round
# ("-": unset, cpq.spin's default; "0": no spinning). The base tree runs with it unset.
# Usage (repo root, on the host): BASE_TGZ=.bench-base.tgz ROUNDS=2 SPINS="- 0" bash tools/gpu/bench_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -c "import zmq" 2>/dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
base=/tmp/bench-base
rm -rf "$base" && mkdir -p "$base" && tar -xzf "${BASE_TGZ:-.bench-base.tgz}" -C "$base"
one() {  # name tree spin round
  if [ "$3" = "-" ]; then unset CPQ_SPIN_US; else export CPQ_SPIN_US=$3; fi
  PYTHONPATH=/tmp/site timeout 240 python3 "$2/tools/bench_core.py" --tasks 1000 \
    --json "$OUT/bench_core_$1_$4.json" > "$OUT/bench_core_$1_$4.txt" 2>&1
  printf '%-12s %s: ' "$1" "$4"
  grep -E "no-op round trip p50|cpq p50 / stdio|CPU per task: (client|broker|rank[0-9])" \
    "$OUT/bench_core_$1_$4.txt" | grep -v " 0 us" | sed -E 's/ +/ /g' | tr '\n' ';'
  echo
}
for round in $(seq "${ROUNDS:-2}"); do
  one base "$base" - "$round"
  for spin in ${SPINS:--}; do
    one "new_spin$spin" "$(pwd)" "$spin" "$round"
  done
done
unset CPQ_SPIN_US
