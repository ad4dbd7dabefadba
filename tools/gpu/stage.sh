#!/usr/bin/env bash
# On the H200 host, once per device call that carries a part of TE (.whl-te/pN): copy the parts
# that arrived into /tmp/te (only what is new there) and say which of the five are staged.
# "staged 3/5" after the third call means the machine stayed warm; a count that fell back
# means the machine was given back in between and staging has to start again from p0.
#
# Usage (repo root, on the GPU host):  tools/gpu/stage.sh [SRC]    (SRC defaults to .whl-te)
set -eu
src=${1:-.whl-te}
mkdir -p /tmp/te
if ls "$src"/p*/* >/dev/null 2>&1; then
  cp -u "$src"/p*/* /tmp/te/
fi
have=0
missing=""
for i in 0 1 2 3 4; do
  if [ -f "/tmp/te/tepart.$i" ]; then have=$((have + 1)); else missing="$missing p$i"; fi
done
ls /tmp/te/transformer_engine_torch-*.tar.gz >/dev/null 2>&1 || missing="$missing (sdist: p4)"
echo "staged $have/5 TE parts in /tmp/te ($(du -sh /tmp/te | cut -f1))${missing:+; missing:$missing}"
if [ -f /tmp/site/.cpq-te-installed ]; then echo "TE already installed in /tmp/site"; fi
