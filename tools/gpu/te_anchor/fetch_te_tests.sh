#!/usr/bin/env bash
# Put Transformer Engine's own CP attention test files into .te-tests/ (git-ignored: they are
# NVIDIA's, Apache-2.0, and never committed here), laid out as TE_PATH expects:
#
#   .te-tests/pytest.ini                                        (rootdir marker, empty)
#   .te-tests/tests/pytorch/utils.py                            TE commit 009e6518
#   .te-tests/tests/pytorch/attention/test_attention_with_cp.py TE commit 36b65fb3
#   .te-tests/tests/pytorch/attention/run_attention_with_cp_pool.py   TE commit 36b65fb3
#   .te-tests/tests/pytorch/attention/run_attention_with_cp.py  see below
#
# Which versions, and why (details in README.md here): TE 2.20.2 is what the H200 host gets.
# Its release carries no tests, and the pooled CP runner (PR #2993, "CP Tests batching using
# subprocess worker pool") came after the 2.20 branch point, so these are main-branch
# versions chosen to import and run against the 2.20.2 wheels: test file and pool script from
# one commit (36b65fb3d213f69aa7d12cc9e8d37e69f6c4865a), tests/pytorch/utils.py from
# 009e65183e5602a024b75b697472a14f4912116d, and run_attention_with_cp.py from the one stored
# main-branch version with NVTE_CP_POOL_PG support whose TE imports all exist in 2.20.2 (the
# index that served it names no commit; its sha256 is below and this script finds the commit
# in a clone's history by content).
#
# Usage (repo root):
#   tools/gpu/te_anchor/fetch_te_tests.sh [TE_CLONE]   # from a TransformerEngine git clone
#                                                      # (default: clone it into /tmp)
#   tools/gpu/te_anchor/fetch_te_tests.sh --check      # verify what is in .te-tests/
set -euo pipefail
cd "$(dirname "$0")/../../.."
dest=.te-tests

# path in TE's repository | commit ("" = search history by content) | sha256 of the file
FILES=(
  "tests/pytorch/utils.py|009e65183e5602a024b75b697472a14f4912116d|be1b895743767bc429f0f11035710424a41dcefa6fca2d0479c2bc8826e8c17c"
  "tests/pytorch/attention/test_attention_with_cp.py|36b65fb3d213f69aa7d12cc9e8d37e69f6c4865a|4a424146fbad2f28f5e45f6ce9a3875764814e4bed28071ba3abcaaff793fa36"
  "tests/pytorch/attention/run_attention_with_cp_pool.py|36b65fb3d213f69aa7d12cc9e8d37e69f6c4865a|104d77ca21e01da7e14b7893884befdfc581754deded24a54012ee1007b5d641"
  "tests/pytorch/attention/run_attention_with_cp.py||f29c294ad907d2d8067541741366af87f2556f16f983d57015110fdf25be3e76"
)

check() {
  local bad=0 path commit sum
  for entry in "${FILES[@]}"; do
    IFS='|' read -r path commit sum <<<"$entry"
    if [ ! -f "$dest/$path" ]; then
      echo "missing  $dest/$path"; bad=1
    elif [ "$(sha256sum "$dest/$path" | cut -d' ' -f1)" != "$sum" ]; then
      echo "DIFFERS  $dest/$path (sha256 is not the recorded one)"; bad=1
    else
      echo "ok       $dest/$path"
    fi
  done
  return $bad
}

if [ "${1:-}" = "--check" ]; then
  check
  exit $?
fi

clone=${1:-/tmp/TransformerEngine}
if [ ! -d "$clone/.git" ]; then
  git clone --filter=blob:none https://github.com/NVIDIA/TransformerEngine.git "$clone"
fi
mkdir -p "$dest/tests/pytorch/attention"
printf '# rootdir for TE test files run by tools/gpu/te_anchor (see fetch_te_tests.sh)\n[pytest]\n' \
  >"$dest/pytest.ini"
for entry in "${FILES[@]}"; do
  IFS='|' read -r path commit sum <<<"$entry"
  found=""
  candidates=$commit
  [ -n "$candidates" ] || candidates=$(git -C "$clone" log --all --format=%H -- "$path")
  for c in $candidates; do
    if [ "$(git -C "$clone" show "$c:$path" 2>/dev/null | sha256sum | cut -d' ' -f1)" = "$sum" ]; then
      git -C "$clone" show "$c:$path" >"$dest/$path"
      found=$c
      break
    fi
  done
  if [ -n "$found" ]; then
    echo "$path <- $found"
  else
    echo "$path: no version with sha256 $sum in $clone (see README.md)" >&2
    exit 1
  fi
done
check
