#!/usr/bin/env bash
# The GPU measurements of the README, in one place, for a machine with 2+ GPUs (NVLink).
# Usage: bash scripts/run_gpu_benchmarks.sh OUT_DIR [tests|dist|train|search|all]
# Multicast stays off (shared machines); each part writes its results JSON/PNG into OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: run_gpu_benchmarks.sh OUT_DIR [tests|dist|train|search|all]}
part=${2:-all}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
mkdir -p "$out"
run() { echo "== $*"; "$@"; }
if [[ $part == tests || $part == all ]]; then
  run python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log" | tail -15
fi
if [[ $part == dist || $part == all ]]; then
  run timeout 600 torchrun --nproc_per_node "$gpus" scripts/bench_dist_attn.py --backends sdpa_cudnn,triton \
    --reps 3 --out "$out" 2>&1 | tail -40
fi
if [[ $part == train || $part == all ]]; then
  run timeout 600 torchrun --nproc_per_node "$gpus" scripts/bench_train.py --seqs 65536,131072 \
    --variants remat,hf,torch_cp --steps 2 --out "$out" 2>&1 | grep '^{'
  for model in 7b-gqa 7b-33h; do
    run timeout 300 torchrun --nproc_per_node "$gpus" scripts/bench_train.py --model "$model" --seqs 65536 \
      --variants remat,torch_cp --steps 2 --out "$out" 2>&1 | grep '^{'
  done
fi
if [[ $part == search || $part == all ]]; then
  run timeout 900 torchrun --nproc_per_node "$gpus" scripts/bench_train.py --search-max-context \
    --seqs 131072 --variants remat,torch_cp --steps 1 --out "$out/search" 2>&1 | grep '^{'
  run timeout 600 torchrun --nproc_per_node 1 scripts/bench_train.py --search-max-context --seqs 16384 \
    --variants single --steps 1 --out "$out/single" 2>&1 | grep '^{'
fi
