#!/usr/bin/env bash
# The GPU measurements of the README, in one place, for a machine with 2+ GPUs (NVLink).
# Usage: bash scripts/run_gpu_benchmarks.sh OUT_DIR [tests|dist|packed|train-main|train|search|search-ours|search-cp|
#                                                  prefill|x4|x4-train|maxctx-*|peers-*|all]
#   tests        the GPU test modules (scripts/run_gpu_tests.sh; log OUT_DIR/gpu-tests.log)
#   dist         distributed attention against torch CP and one GPU, with ablations and a 32K trace
#                (BACKENDS=triton: the Triton local kernel, in its own results file)
#   packed       packed rows (64K, 128K; log-normal document lengths): ours against the same tokens unpacked,
#                torch CP, an all-gather varlen ring and padded documents, after a GPU exactness check
#   train-main   training steps at 64K (remat, HF checkpointing, torch CP) and 128K (remat, torch CP)
#   train        training steps at 32K, the GQA and 33-head models at 64K, one GPU's longest context
#   search-ours  longest context of ours: lengths in ascending order until a step fails
#   search-cp    the same for torch context parallel
#   search       both searches
#   maxctx-*     longest context per memory option, into OUT_DIR/maxctx-<device>-x<P>-<date>.json (each call appends; <= 9.5 min):
#                maxctx-128k (step time at 128K: default, +offload, +tiled, +offload+tiled),
#                maxctx-ours (remat+offloadauto+tiled: the planner's fewest offloaded layers for this
#                GPU and host), maxctx-ours-cpuadam (+ FSDP2 CPU offload),
#                maxctx-cp (torch CP at its best: chunked loss + transformers' offload), maxctx-cp-plain
#                (chunked loss, HF checkpointing without offload); SEQS overrides a search's ladder
#   maxctx-plan  the longest-context ladder's plan (scripts/maxctx_ladder.py plan): per model, ours with the
#                planner's options and torch CP at its best, their first rungs and estimated minutes; runs nothing
#   maxctx-start that ladder, detached (returns at once): each rung one full optimizer step in its own launch
#                under its own time limit; HOST_GIB the host's memory (required: 256 for 2 GPUs, 512 for 4),
#                MODELS (8b,7b), BUDGET_MIN (15), RUNG_MIN (default BUDGET_MIN / ladders), GPUS (all)
#   maxctx-poll  the ladder's progress and summary, waiting up to WAIT seconds (540) for its end
#   peers-start  the training step against ALST and torch CP (scripts/bench_peers.py, detached; ALST needs
#                scripts/install_peers.sh's wheels): MODELS (8b,7b), SEQS (131072), VARIANTS (remat,alst,torch_cp)
#   peers-poll   its log's end, waiting up to WAIT seconds (540) for its end
#   prefill      first-token latency (scripts/bench_prefill.py, forward only, 7B shape): one GPU at 32K-128K
#                (SEQS1), then all GPUs at 32K-512K (SEQS; ours against torch CP, with the one-GPU rows)
#   x4           the 4-GPU set in one call (<= 9 min, each step under its own time limit):
#                bench_dist_attn 32K-256K (cuDNN, both head layouts, ablations, per-rank compute and replay,
#                a 64K trace), prefill on one GPU (32K-128K) and on all GPUs (32K-256K), and the 256K
#                per-rank compute again with the ranks on the GPUs in reverse order (slow GPU or slow rank?)
#   x4-train     the 4-GPU training half on 4 GPUs (<= 9.5 min): bench_dist_attn 32K-256K as in x4 (X4_DIST=0
#                skips it), then Llama-2-7B training steps at TRAIN_SEQS (128K and 256K), ours (remat) against torch CP
# (prefill, x4 and x4-train are not part of all)
# Multicast stays off (shared machines); each part writes its results JSON/PNG into OUT_DIR. Every
# benchmark process starts with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless it is set.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: run_gpu_benchmarks.sh OUT_DIR [tests|dist|packed|train-main|train|search|search-ours|search-cp|maxctx-*|all]}
part=${2:-all}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
if [[ $part == maxctx-poll || $part == peers-poll ]]; then  # a detached run holds the GPUs: no busy check
  [[ $part == maxctx-poll ]] && runner=scripts/maxctx_ladder.py || runner=scripts/bench_peers.py
  python3 "$runner" poll --out "$out" --wait "${WAIT:-540}"
  exit $?
fi
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
# A benchmark sharing the GPUs measures the other process too (a call cut off at its time limit can
# leave its workers running): refuse to start rather than record such times.
busy=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr '\n' ' ')
if [[ -n ${busy// /} ]]; then
  echo "the GPUs are in use by processes $busy; stop them (kill PID) and run again" >&2
  exit 1
fi
run() { echo "== $*"; "$@"; }
# wait_idle: a part cut off by its time limit may leave workers holding the GPUs for a few seconds
wait_idle() { for _ in $(seq 30); do
    [[ -z $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' \n') ]] && return
    sleep 1; done; echo "GPUs still busy after 30 s" >&2; }
# summary GLOB: the newest matching results file's summary on one line
summary() { local f; f=$(ls -t $1 2>/dev/null | head -1); [[ -n $f ]] || { echo "no $1"; return; }
  python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['summary']; p=s.pop('per_seq', None)
print(sys.argv[1], json.dumps(s)[:1500]); print('per_seq', json.dumps(p)[:1500])" "$f"; }
# quiet: keep a part's errors, drop its per-row JSON (the files hold them)
quiet() { awk 'n < 20 && /Error|error:|Traceback|^\[/ { print substr($0, 1, 300); n++ }'; }
# train SECONDS NPROC ARGS...: a training benchmark under a time limit (a rank left alone by an
# out-of-memory peer would otherwise wait forever)
train() { local limit=$1 n=$2; shift 2
  run timeout "$limit" torchrun --nproc_per_node "$n" scripts/bench_train.py "$@" 2>&1 \
    | grep -E '^\{|Error' | cut -c1-400; }
if [[ $part == tests || $part == all ]]; then
  run bash scripts/run_gpu_tests.sh --log "$out/gpu-tests.log" -q 2>&1 | tail -25
fi
if [[ $part == dist || $part == all ]]; then
  # BACKENDS=sdpa_cudnn (default) gives the ablations too; another local kernel gets its own file
  backends=${BACKENDS:-sdpa_cudnn} extra=()
  [[ $backends == sdpa_cudnn ]] || extra=(--no-ablations --tag "${backends//,/-}")
  run timeout 580 torchrun --nproc_per_node "$gpus" scripts/bench_dist_attn.py --backends "$backends" \
    "${extra[@]}" --reps 3 --trace --trace-seq 32768 --out "$out" 2>&1 | tail -30
fi
if [[ $part == packed || $part == all ]]; then
  run timeout 480 torchrun --nproc_per_node "$gpus" scripts/bench_packed.py --out "$out" 2>&1 | tail -40
fi
if [[ $part == train-main || $part == all ]]; then
  train 280 "$gpus" --seqs 65536 --variants remat,hf,torch_cp --steps 3 --tag 64k --out "$out"
  train 300 "$gpus" --seqs 131072 --variants remat,torch_cp --steps 3 --tag 128k --out "$out"
fi
if [[ $part == train || $part == all ]]; then
  train 200 "$gpus" --seqs 32768 --variants remat,hf,torch_cp --steps 2 --tag 32k --out "$out"
  for model in 7b-gqa 7b-33h; do
    train 150 "$gpus" --model "$model" --seqs 65536 --variants remat,torch_cp --steps 2 --out "$out"
  done
  train 200 1 --search-max-context --seqs 8192,16384,32768,65536 --variants single --steps 2 \
    --out "$out/single"
fi
# A search probe is one step with the AdamW state allocated first (1.5-2.5 minutes per length at
# 256K-320K, model set-up included); SEQS overrides each one's ladder.
if [[ $part == search-ours || $part == search || $part == all ]]; then
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True train 280 "$gpus" --search-max-context \
    --seqs "${SEQS:-262144,294912}" --variants remat --steps 1 --tag search-ours --out "$out"
fi
if [[ $part == search-cp || $part == search || $part == all ]]; then
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True train 300 "$gpus" --search-max-context \
    --seqs "${SEQS:-294912,327680}" --variants torch_cp --steps 1 --tag search-cp --out "$out"
fi
# longest context with each memory option, and the peer at its best (one call per part)
maxctx() { PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True train 570 "$gpus" --steps 1 --search-max-context \
  --time-budget 500 --out "$out" "$@"; }
case $part in
  maxctx-128k) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True train 570 "$gpus" --maxctx --steps 2 \
    --seqs 131072 --variants remat,remat+offload,remat+tiled,remat+offload+tiled --out "$out" ;;
  maxctx-ours) maxctx --seqs "${SEQS:-557056}" --variants "${VARIANTS:-remat+offloadauto+tiled}" ;;
  maxctx-ours-cpuadam) maxctx --seqs "${SEQS:-524288,655360}" --variants remat+offload+tiled+cpuadam ;;
  maxctx-cp) maxctx --seqs "${SEQS:-524288,655360}" --variants torch_cp+offload ;;
  maxctx-cp-plain) maxctx --seqs "${SEQS:-294912,327680}" --variants torch_cp ;;
  maxctx-plan|maxctx-start)
    ladder=(--out "$out" --gpus "${GPUS:-$gpus}" --host-gib "${HOST_GIB:?HOST_GIB: the host memory in GiB (256 for 2 GPUs, 512 for 4)}"
            --models "${MODELS:-8b,7b}" --budget-min "${BUDGET_MIN:-15}" ${RUNG_MIN:+--rung-min "$RUNG_MIN"})
    python3 scripts/maxctx_ladder.py "${part#maxctx-}" "${ladder[@]}" ;;
  peers-start) python3 scripts/bench_peers.py start --models "${MODELS:-8b,7b}" --seqs "${SEQS:-131072}" \
    --variants "${VARIANTS:-remat,alst,torch_cp}" --out "$out" ;;
esac
if [[ $part == prefill ]]; then
  run timeout 200 torchrun --nproc_per_node 1 scripts/bench_prefill.py --seqs "${SEQS1:-32768,65536,131072}" \
    --reps 2 --out "$out" 2>&1 | quiet
  summary "$out/prefill-*-x1-*.json"
  wait_idle
  if (( gpus > 1 )); then
    single=$(ls -t "$out"/prefill-*-x1-*.json 2>/dev/null | head -1)
    run timeout 380 torchrun --nproc_per_node "$gpus" scripts/bench_prefill.py --reps 2 \
      --seqs "${SEQS:-32768,65536,131072,262144,524288}" ${single:+--single-from "$single"} --out "$out" 2>&1 | quiet
    summary "$out/prefill-*-x$gpus-*.json"
  fi
fi
if [[ $part == x4 ]]; then
  # Estimated from the 4 x H200 numbers: dist ~170 s, prefill one GPU ~80 s, prefill 4 GPUs ~150 s,
  # the reversed-order check ~45 s (process start and model set-up included); limits add ~30% each and
  # a deadline keeps the sum under 9 minutes.
  (( gpus == 4 )) || echo "warning: part x4 expects 4 GPUs, found $gpus" >&2
  deadline=$((SECONDS + 530))
  limit() { local rest=$((deadline - SECONDS)); (( rest < $1 )) && echo $(( rest > 5 ? rest : 5 )) || echo "$1"; }
  step() { echo "[x4 $(date +%T), ${SECONDS}s] $*"; }
  step "1/4 bench_dist_attn 32K-256K: cuDNN, heads 32/32 and 32/8, ablations, compute-only and replay per rank, trace at 64K"
  run timeout "$(limit 230)" torchrun --nproc_per_node "$gpus" scripts/bench_dist_attn.py --backends sdpa_cudnn \
    --seqs 32768,65536,131072,262144 --reps 3 --replay --trace --trace-seq 65536 --out "$out" 2>&1 | quiet
  summary "$out/dist-*-x$gpus-*[0-9].json"
  wait_idle
  step "2/4 prefill on one GPU, 32K-128K"
  run timeout "$(limit 110)" torchrun --nproc_per_node 1 scripts/bench_prefill.py --seqs 32768,65536,131072 \
    --reps 2 --out "$out" 2>&1 | quiet
  summary "$out/prefill-*-x1-*.json"
  wait_idle
  step "3/4 prefill on $gpus GPUs, 32K-256K, ours and torch CP"
  single=$(ls -t "$out"/prefill-*-x1-*.json 2>/dev/null | head -1)
  run timeout "$(limit 190)" torchrun --nproc_per_node "$gpus" scripts/bench_prefill.py --reps 2 \
    --seqs 32768,65536,131072,262144 ${single:+--single-from "$single"} --out "$out" 2>&1 | quiet
  summary "$out/prefill-*-x$gpus-*.json"
  wait_idle
  step "4/4 per-rank compute at 256K with the ranks on the GPUs in reverse order"
  run timeout "$(limit 70)" torchrun --nproc_per_node "$gpus" scripts/bench_dist_attn.py --backends sdpa_cudnn \
    --seqs 262144 --heads 32/32 --reps 3 --no-torch-cp --no-single --no-ablations --replay \
    --device-order reversed --tag reversed-gpus --out "$out" 2>&1 | quiet
  summary "$out/dist-*-x$gpus-*-reversed-gpus.json"
  step "done"
fi
if [[ $part == x4-train ]]; then
  # dist ~170 s; a 7B step with set-up: 128K ~45 s per variant, 256K ~110 s (measured: 37.8 / 46.4 s a step).
  # X4_DIST=0 skips step 1; TRAIN_SEQS picks the lengths; BUDGET_S bounds the part (default 560 s).
  deadline=$((SECONDS + ${BUDGET_S:-560}))
  limit() { local rest=$((deadline - SECONDS)); (( rest < $1 )) && echo $(( rest > 5 ? rest : 5 )) || echo "$1"; }
  step() { echo "[x4-train $(date +%T), ${SECONDS}s] $*"; }
  if [[ ${X4_DIST:-1} != 0 ]]; then
    step "bench_dist_attn 32K-256K: cuDNN, both head layouts, ablations, compute-only and replay per rank, 64K trace"
    run timeout "$(limit 220)" torchrun --nproc_per_node "$gpus" scripts/bench_dist_attn.py --backends sdpa_cudnn \
      --seqs 32768,65536,131072,262144 --reps 3 --replay --trace --trace-seq 65536 --out "$out" 2>&1 | quiet
    summary "$out/dist-*-x$gpus-*[0-9].json"
    wait_idle
  fi
  for n in ${TRAIN_SEQS:-131072 262144}; do
    step "Llama-2-7B training steps at $((n / 1024))K: remat, torch CP"
    train "$(limit $(( n > 131072 ? 240 : 150 )))" "$gpus" --seqs "$n" --variants remat,torch_cp --steps 2 \
      --tag "$((n / 1024))k" --out "$out"
    wait_idle
  done
  step "done"
fi

