#!/usr/bin/env bash
# The benchmarks' peers, an optional install (never a dependency of lightseq_hf): ALST's DeepSpeed.
#
#   bash scripts/install_peers.sh                 # into the active Python environment (needs the package index)
#   bash scripts/install_peers.sh --wheels DIR    # wheels for a machine without the index (Python 3.12, x86-64,
#                                                 # as the GPU machines have), to install there with
#                                                 # pip install --no-index --no-deps DIR/*.whl
#
# DeepSpeed 0.19.8 is published as a source distribution only. Built with DS_BUILD_OPS=0 (and torch
# importable, hence --no-build-isolation) it is a pure-Python wheel of about 2 MB that compiles the ops it
# uses on first use (CPU Adam for ALST's optimizer on the host: g++, ninja and Python's headers). Its imports
# need msgpack, hjson, einops, py-cpuinfo, psutil, ninja and pydantic 2.
set -euo pipefail
cd "$(dirname "$0")/.."
DEEPSPEED=deepspeed==0.19.8
NEEDS=(msgpack hjson einops py-cpuinfo psutil ninja "pydantic>=2.7")
if [[ ${1:-} == --wheels ]]; then
  dir=${2:?usage: install_peers.sh --wheels DIR}
  mkdir -p "$dir"
  DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$DEEPSPEED"
  python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "${NEEDS[@]}"
  ls "$dir"
  exit 0
fi
python -c "import torch" 2>/dev/null || { echo "install_peers.sh: install torch first (DeepSpeed's build imports it)" >&2; exit 2; }
python -m pip install -q -c constraints.txt "${NEEDS[@]}"
DS_BUILD_OPS=0 python -m pip install -q --no-deps --no-build-isolation "$DEEPSPEED"
python -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -n 1
