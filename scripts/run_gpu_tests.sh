#!/usr/bin/env bash
# Every GPU test (tests/gpu) on the GPUs this machine has, in one command, with a log; or one shard of them.
# Usage: bash scripts/run_gpu_tests.sh [--dry-run] [--log FILE] [--shard I/N | --list [--shards N]] [--gpus G]
#                                      [TEST_PATH...] [PYTEST_OPTION...]
#   --dry-run    no test runs: print the environment, the GPUs and the pytest command, and collect the tests
#                (what the present GPUs cannot run is listed as skipped, with the reason)
#   --log FILE   the log (default runs/gpu-tests-<date>-<time>[-shard-I-of-N].log); written as the run goes
#   --shard I/N  only shard I of N: the suite split by each test's expected duration (tests/gpu/durations.tsv,
#                tests/gpu/shards.py), the same split for the same N and GPU count; run I = 1..N, one call each
#   --list       print each shard's tests and expected seconds (N: --shards, default the fewest that each end
#                within 8 minutes) and exit; runs without a GPU
#   --gpus G     plan the shards for G GPUs (default: the GPUs this machine has)
#   TEST_PATH    tests/gpu/... files or test ids instead of all of tests/gpu; other arguments go to pytest
# The caller's environment is kept: PYTHONPATH is extended with this checkout, and NVLink multicast stays
# off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1). Tests needing more
# GPUs than are present skip with the reason; multi-GPU tests start their own processes (spawned NCCL
# groups, torchrun, accelerate launch). PYTHON picks the interpreter (default python3); GPU_TESTS_TIMEOUT
# bounds the whole run in seconds (default 570, inside a 10-minute call).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
dry_run=0 log="" shard="" list=0 shards="" gpus="" targets=() options=()
while (( $# )); do
  case $1 in
    --dry-run) dry_run=1 ;;
    --log) log=${2:?--log needs a file}; shift ;;
    --shard) shard=${2:?--shard needs I/N}; shift ;;
    --list) list=1 ;;
    --shards) shards=${2:?--shards needs a count}; shift ;;
    --gpus) gpus=${2:?--gpus needs a count}; shift ;;
    tests/*) targets+=("$1") ;;
    *) options+=("$1") ;;
  esac
  shift
done
planner=("$python" tests/gpu/shards.py)
if (( list )); then
  exec "${planner[@]}" list ${shards:+--shards "$shards"} ${gpus:+--gpus "$gpus"}
fi
if [[ -n $shard ]]; then
  if (( ${#targets[@]} )); then
    echo "run_gpu_tests.sh: --shard runs its part of the whole suite; pass test paths or --shard, not both" >&2
    exit 2
  fi
  "${planner[@]}" shard "$shard" ${gpus:+--gpus "$gpus"} > /dev/null || exit 2  # I/N checked here
  export GPU_TESTS_SHARD=$shard  # tests/gpu/conftest.py keeps this shard's tests
  [[ -n $gpus ]] && export GPU_TESTS_GPUS=$gpus
fi
(( ${#targets[@]} )) || targets=(tests/gpu)
log=${log:-runs/gpu-tests-$(date +%F-%H%M%S)${shard:+-shard-${shard/\//-of-}}.log}
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
  [[ -n $shard ]] && echo "GPU_TESTS_SHARD=$shard (tests/gpu/shards.py list${gpus:+ --gpus $gpus} shows the plan)"
  echo "+ ${command[*]}"
} 2>&1 | tee "$log"
timeout "${GPU_TESTS_TIMEOUT:-570}" "${command[@]}" 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}
(( dry_run && status == 5 )) && status=0  # pytest's "no tests collected": every module skipped here
(( status == 124 )) && echo "stopped after ${GPU_TESTS_TIMEOUT:-570} s (GPU_TESTS_TIMEOUT)" | tee -a "$log"
echo "exit $status; log: $log" | tee -a "$log"
exit "$status"
