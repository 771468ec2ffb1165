#!/usr/bin/env bash
# Every GPU test (tests/gpu) on the GPUs this machine has, in one command, with a log.
# Usage: bash scripts/run_gpu_tests.sh [--dry-run] [--log FILE] [TEST_PATH...] [PYTEST_OPTION...]
#   --dry-run   no test runs: print the environment, the GPUs and the pytest command, and collect the tests
#               (what the present GPUs cannot run is listed as skipped, with the reason)
#   --log FILE  the log (default runs/gpu-tests-<date>-<time>.log); written as the run goes
#   TEST_PATH   tests/gpu/... files or test ids instead of all of tests/gpu; other arguments go to pytest
# The caller's environment is kept: PYTHONPATH is extended with this checkout, and NVLink multicast stays
# off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1). Tests needing more
# GPUs than are present skip with the reason; multi-GPU tests start their own processes (spawned NCCL
# groups, torchrun, accelerate launch). PYTHON picks the interpreter (default python3); GPU_TESTS_TIMEOUT
# bounds the whole run in seconds (default 570, inside a 10-minute call).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
dry_run=0 log="" targets=() options=()
while (( $# )); do
  case $1 in
    --dry-run) dry_run=1 ;;
    --log) log=${2:?--log needs a file}; shift ;;
    tests/*) targets+=("$1") ;;
    *) options+=("$1") ;;
  esac
  shift
done
(( ${#targets[@]} )) || targets=(tests/gpu)
log=${log:-runs/gpu-tests-$(date +%F-%H%M%S).log}
mkdir -p "$(dirname "$log")"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
command=("$python" -m pytest "${targets[@]}" -v -rs --durations=0 -p no:cacheprovider "${options[@]}")
(( dry_run )) && command+=(--collect-only)
{
  echo "# GPU tests, $(date '+%F %T'), $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  "$python" -c "import sys, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f'python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}; {n} CUDA GPUs')
for i in range(n):
    print(f'  GPU {i}: {torch.cuda.get_device_name(i)}')"
  for name in PYTHONPATH CUDA_VISIBLE_DEVICES NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS; do
    echo "$name=${!name-(unset)}"
  done
  echo "+ ${command[*]}"
} 2>&1 | tee "$log"
timeout "${GPU_TESTS_TIMEOUT:-570}" "${command[@]}" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
(( dry_run && status == 5 )) && status=0  # pytest's "no tests collected": every module skipped here
(( status == 124 )) && echo "stopped after ${GPU_TESTS_TIMEOUT:-570} s (GPU_TESTS_TIMEOUT)" | tee -a "$log"
echo "exit $status; log: $log" | tee -a "$log"
exit "$status"
