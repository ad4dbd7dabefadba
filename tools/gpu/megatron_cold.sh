#!/usr/bin/env bash
# Cold `pytest --cpq-world-size 1` sessions of Megatron-LM's 281 tests on the one-H200 host,
# with pytest's cache on (run.sh turns it off): each session on a broker started just before
# it, with no group, as after the background broker idled out. The first session writes the
# cache's warm-up entry; the later ones ask for that group before their conftests import
# (cpq/client/early_warm.py). Prints each session's wall, its summary and cpq's line on the
# wait for groups. Run from the repo root after .megatron/run.sh ran once in this machine
# (it installs the staged wheels and pyzmq); the same carried folders.
#   MEG_FRESH_XML: a fresh run's JUnit file (run.sh's meg-fresh.xml) to compare verdicts with.
set -uo pipefail
PROJ=$(pwd); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/cold"
export PYTHONPATH=/tmp/site:/tmp/msite:$PROJ:$PROJ/.megatron/src
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export HTTPS_PROXY=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 http_proxy=http://127.0.0.1:9
FILES=(tests/unit_tests/test_parallel_state.py tests/unit_tests/tensor_parallel
  tests/unit_tests/distributed/test_param_and_grad_buffer.py tests/unit_tests/transformer/test_mlp.py
  tests/unit_tests/transformer/test_module.py tests/unit_tests/transformer/test_rope.py
  tests/unit_tests/transformer/test_relative_attention.py tests/unit_tests/transformer/test_spec_utils.py
  tests/unit_tests/fusions/test_torch_softmax.py tests/unit_tests/models/test_base_embedding.py
  tests/unit_tests/models/test_multimodal_projector.py)
cd "$PROJ/.megatron/src" || exit 3
rm -rf .pytest_cache
# 1: no cache yet (it writes one); 2, 4: the cache's group asked for early; 3: the cache
# plugin off (nothing asked for early), after the others, so the disk cache is as warm.
for i in 1 2 3 4; do
  extra=(); [ "$i" = 3 ] && extra=(-p no:cacheprovider)
  export CPQ_STATE_DIR; CPQ_STATE_DIR=$(mktemp -d /tmp/meg-cold.XXXXXX); chmod 700 "$CPQ_STATE_DIR"
  python3 -m cpq broker --gpus auto > "$OUT/cold/broker-$i.out" 2>&1 &
  broker=$!
  for _ in $(seq 1 120); do python3 -m cpq status --json > /dev/null 2>&1 && break; sleep 0.25; done
  t0=$(date +%s.%N)
  python3 -m pytest -p cpq.client.plugin "${extra[@]}" --cpq-world-size 1 -q "${FILES[@]}" \
    --junitxml="$OUT/cold/cold-$i.xml" > "$OUT/cold/cold-$i.log" 2>&1
  t1=$(date +%s.%N)
  echo "COLD $i: wall $(python3 -c "print(round($t1 - $t0, 1))")s ${extra[*]:-cache on} :: \
$(grep -E '(passed|failed).* in [0-9.]+s' "$OUT/cold/cold-$i.log" | tail -1) :: \
$(grep -o -E '[0-9.]+s waiting for groups to start' "$OUT/cold/cold-$i.log" | tail -1)"
  python3 -m cpq stop > /dev/null 2>&1
  timeout 30 tail --pid="$broker" -f /dev/null || kill -9 "$broker"
done
if [ -f "${MEG_FRESH_XML:-}" ]; then
  python3 "$PROJ/.megatron/compare.py" "$MEG_FRESH_XML" "$OUT"/cold/cold-*.xml | grep SUMMARY
fi
