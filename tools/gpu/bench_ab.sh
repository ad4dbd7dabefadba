#!/usr/bin/env bash
# The no-op round trip of two cpq trees side by side on the device host, alternated, each
# run with its own stdio pool (tools/bench_core.py): this checkout ("new") against a base
# tree unpacked from $BASE_TGZ ("base", made here with
# `git archive BASE cpq tools workers | gzip > .bench-base.tgz`; git-ignored, carried).
# Usage (repo root, on the host): BASE_TGZ=.bench-base.tgz ROUNDS=2 bash tools/gpu/bench_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ! python3 -c "import zmq" 2>/dev/null; then
  python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
base=/tmp/bench-base
rm -rf "$base" && mkdir -p "$base" && tar -xzf "${BASE_TGZ:-.bench-base.tgz}" -C "$base"
for round in $(seq "${ROUNDS:-2}"); do
  for tree in "$base" "$(pwd)"; do
    name=$([ "$tree" = "$base" ] && echo base || echo new)
    PYTHONPATH=/tmp/site timeout 240 python3 "$tree/tools/bench_core.py" --tasks 1000 \
      --json "$OUT/bench_core_${name}_$round.json" > "$OUT/bench_core_${name}_$round.txt" 2>&1
    printf '%s %s: ' "$name" "$round"
    grep -E "no-op round trip p50|cpq p50 / stdio|CPU per task: (client|broker|rank[0-9])" \
      "$OUT/bench_core_${name}_$round.txt" | grep -v " 0 us" | sed -E 's/ +/ /g' | tr '\n' ';'
    echo
  done
done
