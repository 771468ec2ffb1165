#!/usr/bin/env bash
# One 4-GPU session, detached: every step under its own time limit, by priority; a status line per step.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${1:-runs/x4}; mkdir -p "$R"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
log() { echo "[$(date +%T) ${SECONDS}s] $*" >> "$R/status"; }
log "start $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tr -s ' ')"
python3 -m pip install -q --no-deps .whl/*.whl > "$R/pip.log" 2>&1
python3 -c "import pydantic, datasets, cudnn, torch, transformers; print('wheels ok', torch.__version__, transformers.__version__, datasets.__version__)" >> "$R/status" 2>&1
busy() { nvidia-smi --query-compute-apps=pid --format=csv,noheader | tr -d ' \n'; }
idle() { for _ in $(seq 30); do [[ -z $(busy) ]] && return; sleep 1; done; log "GPUs still busy"; }

log "1 finetune: shipped 8B 256K 4-GPU config through accelerate launch, no allocator variable"
env -u PYTORCH_CUDA_ALLOC_CONF X4_RUNS=8b-256k timeout 420 bash scripts/run_gpu_finetune.sh "$R/ft" x4 > "$R/finetune-x4.log" 2>&1
log "exit $?: $(tail -2 "$R/finetune-x4.log" | tr '\n' ' ' | cut -c1-300)"; idle

log "2 bench_dist_attn 32K-128K, heads 32/32, balanced and pipelined, traces at 32K"
timeout 300 torchrun --nproc_per_node 4 scripts/bench_dist_attn.py --backends sdpa_cudnn --heads 32/32 \
  --seqs 32768,65536,131072 --reps 3 --trace --trace-seq 32768 --trace-schedules balanced,pipelined \
  --out "$R" > "$R/dist.log" 2>&1
log "exit $?"; idle
python3 scripts/trace_exposure.py "$R"/trace-dist-32k-*.json.gz --out "$R/exposure-32k.json" > /dev/null 2>&1
log "exposure $?"

log "3 packed: ring on GPUs 0-1, packed fine-tune on GPUs 2-3"
(CUDA_VISIBLE_DEVICES=2,3 timeout 360 bash scripts/run_gpu_finetune.sh "$R/ftp" packed > "$R/finetune-packed.log" 2>&1
 log "packed fine-tune exit $?") &
sleep 5  # the fine-tune runner checks that no process holds a GPU before it starts
(CUDA_VISIBLE_DEVICES=0,1 timeout 330 torchrun --master_port 29640 --nproc_per_node 2 scripts/bench_packed.py \
   --packed-backends triton,cudnn_fe --out "$R" > "$R/packed.log" 2>&1; log "packed ring exit $?") &
wait; idle

log "4 bench_train 128K: remat (default options) and torch CP"
timeout 220 torchrun --nproc_per_node 4 scripts/bench_train.py --seqs 131072 --variants remat,torch_cp --steps 2 \
  --tag 128k --out "$R" > "$R/train128k.log" 2>&1
log "exit $?"; idle

log "5 GPU tests on two GPU pairs"
(CUDA_VISIBLE_DEVICES=0,1 GPU_TESTS_TIMEOUT=330 bash scripts/run_gpu_tests.sh --log "$R/gpu-tests-a.log" \
   tests/gpu/test_finetune_gpu.py tests/gpu/test_memory_gpu.py tests/gpu/test_out_of_memory_gpu.py > /dev/null 2>&1
 log "tests a exit $?") &
(CUDA_VISIBLE_DEVICES=2,3 GPU_TESTS_TIMEOUT=330 bash scripts/run_gpu_tests.sh --log "$R/gpu-tests-b.log" \
   tests/gpu/test_cudnn_fe_gpu.py tests/gpu/test_dist_gpu.py tests/gpu/test_packed_gpu.py > /dev/null 2>&1
 log "tests b exit $?") &
wait
log "done"
