#!/usr/bin/env bash
# Prepare Transformer Engine (and pyzmq) for the H200 host, whose Python 3.12 has torch 2.11+cu130
# but no TE and no pyzmq, and which reaches no package registry.
# Usage (from the project root): tools/gpu/te-wheels.sh [DEST]   (DEST defaults to .whl-te)
# It writes DEST/p0 .. DEST/p4, each under 60 MB, because a copy to the host is limited to 64 MiB at a
# time: copy p0, p1, ... in turn (each with te-stage.sh), then run te-install.sh there.
set -euo pipefail
dest=${1:-.whl-te}
ver=2.20.2
tmp=$(mktemp -d)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$tmp" \
  "transformer-engine-cu13==$ver" "transformer-engine==$ver" pyzmq pydantic pydantic-core annotated-types typing-inspection
# The torch extension ships only as a source archive, and pip cannot fetch it without running its
# metadata step, which needs a CUDA build of torch: a throw-away venv with the CUDA torch that lies on
# this machine's disk (no download; about 2 minutes) serves for that.
metavenv=${TE_META_VENV:-/tmp/te-meta-venv}
if [ ! -x "$metavenv/bin/python" ]; then
  python3 -m venv "$metavenv"
  "$metavenv/bin/pip" install -q torch==2.14.1 wheel setuptools packaging pybind11
fi
PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=/usr/local/cuda \
  "$metavenv/bin/pip" download -q --no-deps --no-build-isolation -d "$tmp" "transformer-engine-torch==$ver"
ls "$tmp"/transformer_engine_torch-*.tar.gz >/dev/null || { echo "could not fetch transformer_engine_torch sdist"; exit 1; }
rm -rf "$dest"; mkdir -p "$dest"/p0 "$dest"/p1 "$dest"/p2 "$dest"/p3 "$dest"/p4
(cd "$tmp" && split -b 57M -d -a 1 transformer_engine_cu13-$ver-*.whl tepart.)
for i in 0 1 2 3 4; do [ -f "$tmp/tepart.$i" ] && mv "$tmp/tepart.$i" "$dest/p$i/"; done
mv "$tmp"/*.whl "$tmp"/*.tar.gz "$dest/p4/" 2>/dev/null || true
rm -f "$dest"/p4/transformer_engine_cu13-*.whl
du -sh "$dest"/*
