#!/usr/bin/env bash
# The GPU main job, measured: scripts/finetune.py with accelerate's FSDP2 plugin on the GPU configs, beside
# scripts/bench_train.py on the same shapes in the same call, joined by scripts/finetune_report.py.
# Usage: bash scripts/run_gpu_finetune.sh OUT_DIR [x2|x4|packed]
#   x2  (2 GPUs; on a 4-GPU machine the benchmark runs at the same time on GPUs 2-3): the FSDP2 GPU test
#       (tests/gpu/test_finetune_gpu.py), Llama-2-7B at 32K and at 64K through finetune.py, bench_train
#       at 32K and 64K -> OUT_DIR/finetune-<device>-x2-<date>.json
#   x4  (4 GPUs): Llama-2-7B at 64K with sp_size 4, bench_train at 64K, the Llama-3-8B-shaped GQA config at
#       128K and the shipped 256K 4-GPU config (X4_RUNS picks among 7b-64k-sp4 8b-128k 8b-256k)
#       -> OUT_DIR/finetune-<device>-x4-<date>.json
#   packed (2 GPUs, needs the datasets package): Llama-2-7B at 64K on packed documents of log-normal lengths
#       (median 2048 bytes, the bytes tokenizer), once per packed backend (PACKED_BACKENDS, default "triton
#       cudnn_fe") -> OUT_DIR/finetune-packed-<device>-x2-<date>.json with speedup_vs_triton
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: run_gpu_finetune.sh OUT_DIR [x2|x4|packed]}
part=${2:-x2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$out"
busy=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr '\n' ' ')
if [[ -n ${busy// /} ]]; then
  echo "the GPUs are in use by processes $busy; stop them and run again" >&2
  exit 1
fi
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
slug=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace('NVIDIA ', '').replace(' ', '-').lower())")
date=$(date +%F)
fsdp=configs/accelerate/1node-8gpu-fsdp.yaml
quick=(data.synthetic.eval_samples=0 saving.final=false logging.progress_bar=false)
# finetune NAME NPROC PORT CONFIG OVERRIDES...: one finetune.py run under a time limit, its log kept
finetune() { local name=$1 n=$2 port=$3; shift 3
  local cmd="accelerate launch --config_file $fsdp --num_processes $n scripts/finetune.py $* ${quick[*]}"
  echo "== finetune $name: $cmd"
  echo "$cmd" > "$out/$name.log"
  timeout 400 accelerate launch --config_file "$fsdp" --num_processes "$n" --main_process_port "$port" \
    scripts/finetune.py "$@" output_dir="$out/runs/$name" "${quick[@]}" >> "$out/$name.log" 2>&1
  local rc=$?
  echo "   exit $rc; $(grep -E 'done:|Error|error' "$out/$name.log" | tail -3 | cut -c1-300)"
}
bench() { local port=$1; shift
  echo "== bench_train $*"
  timeout 400 torchrun --master_port "$port" "$@" > "$out/bench-$port.log" 2>&1
  echo "   exit $?; $(grep -E '^\{"run|Error' "$out/bench-$port.log" | cut -c1-300)"
}
if [[ $part == x2 ]]; then
  if (( gpus >= 4 )); then
    (CUDA_VISIBLE_DEVICES=2,3 bench 29702 --nproc_per_node 2 scripts/bench_train.py --seqs 32768,65536 \
      --variants remat --steps 3 --tag finetune-ref --out "$out") &
  fi
  export CUDA_VISIBLE_DEVICES=0,1
  echo "== GPU test"; GPU_TESTS_TIMEOUT=420 bash scripts/run_gpu_tests.sh tests/gpu/test_finetune_gpu.py -q \
    --log "$out/gpu-test-finetune.log" > /dev/null 2>&1; tail -3 "$out/gpu-test-finetune.log"
  finetune 7b-32k 2 29611 configs/llama2-7b-32k-2gpu.yaml training.max_steps=4
  finetune 7b-64k 2 29612 configs/llama2-7b-64k.yaml training.max_steps=4 training.grad_accum=1
  wait
  if (( gpus < 4 )); then
    bench 29702 --nproc_per_node 2 scripts/bench_train.py --seqs 32768,65536 --variants remat --steps 3 \
      --tag finetune-ref --out "$out"
  fi
  bj=$out/train-$slug-x2-$date-finetune-ref.json
  python3 scripts/finetune_report.py --out "$out/finetune-$slug-x2-$date.json" \
    --run 7b-32k "$out/runs/7b-32k" "$(head -1 "$out/7b-32k.log")" \
    --run 7b-64k "$out/runs/7b-64k" "$(head -1 "$out/7b-64k.log")" \
    --bench 7b-32k "$bj" 32768 remat --bench 7b-64k "$bj" 65536 remat \
    --note "2 GPUs; bench_train on GPUs 2-3 of the same host at the same time when 4 were present"
fi
if [[ $part == x4 ]]; then
  # X4_RUNS picks the runs (default all three); the 256K run is the shipped 4-GPU config as it is
  x4_runs=" ${X4_RUNS:-7b-64k-sp4 8b-128k 8b-256k} "
  if [[ $x4_runs == *" 7b-64k-sp4 "* ]]; then
    finetune 7b-64k-sp4 4 29621 configs/llama2-7b-64k.yaml sp_size=4 training.max_steps=4 training.grad_accum=1
    bench 29703 --nproc_per_node 4 scripts/bench_train.py --seqs 65536 --variants remat --steps 3 \
      --tag finetune-ref --out "$out"
  fi
  [[ $x4_runs == *" 8b-128k "* ]] && finetune 8b-128k 4 29622 configs/llama3-8b-128k.yaml sp_size=4 \
    training.max_steps=3 training.grad_accum=1
  [[ $x4_runs == *" 8b-256k "* ]] && finetune 8b-256k 4 29623 configs/llama3-8b-256k-4gpu.yaml training.max_steps=3
  runs=()
  for r in 7b-64k-sp4 8b-128k 8b-256k; do
    [[ -f $out/runs/$r/metrics.jsonl ]] && runs+=(--run "$r" "$out/runs/$r" "$(head -1 "$out/$r.log" 2>/dev/null)")
  done
  ref=$out/train-$slug-x4-$date-finetune-ref.json bench_ref=()
  [[ -f $ref ]] && bench_ref=(--bench 7b-64k-sp4 "$ref" 65536 remat)
  python3 scripts/finetune_report.py --out "$out/finetune-$slug-x4-$date.json" "${runs[@]}" "${bench_ref[@]}" \
    --note "4 GPUs"
fi
if [[ $part == packed ]]; then
  python3 -c "import datasets" 2>/dev/null || { echo "part packed reads its documents with the datasets package" \
    "(pip install datasets)" >&2; exit 1; }
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}  # two GPUs (the caller may pick them)
  docs=$out/packed-docs.jsonl files=files  # the file data exists from here on (written below)
  python3 - "$docs" <<'EOF'
import json, random, sys
sys.path.insert(0, "scripts")
from benchlib.workloads import lognormal_docs
letters = random.Random(0)
with open(sys.argv[1], "w") as f:
    for a, b in lognormal_docs(8 * 65536, median=2048, sigma=1.0, max_len=32768, seed=3):
        f.write(json.dumps({"text": "".join(letters.choices("abcdefghijklmnopqrstuvwxyz  ", k=b - a))}) + "\n")
EOF
  runs=() port=29631
  for b in ${PACKED_BACKENDS:-triton cudnn_fe}; do
    finetune "7b-64k-packed-$b" 2 $((port++)) configs/llama2-7b-64k.yaml "data.type=$files" "data.paths=[$docs]" \
      data.format=json tokenizer=bytes training.backend="$b" training.max_steps=4 training.grad_accum=1
    runs+=(--run "$b" "$out/runs/7b-64k-packed-$b" "$(head -1 "$out/7b-64k-packed-$b.log")")
  done
  python3 scripts/finetune_report.py --out "$out/finetune-packed-$slug-x2-$date.json" "${runs[@]}" \
    --speedup cudnn_fe triton --note "2 GPUs; documents of log-normal lengths (median 2048 bytes), bytes tokenizer"
fi
