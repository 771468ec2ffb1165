#!/usr/bin/env bash
# The main job: sequence-parallel fine-tune of a tiny random-init Llama on the synthetic passkey task
# (configs/tiny.yaml), 2 processes. On a machine with 2+ GPUs it runs on 2 GPUs (NCCL), otherwise on 2 CPU
# processes (gloo). Extra arguments are config overrides, e.g. `bash scripts/run_tiny.sh training.max_steps=20`.
# The config (and output_dir) is checked before the launch: a mistake prints one line and exits with 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -ge 2 ]; then
  python scripts/finetune.py configs/tiny.yaml --check --world-size 2 "$@"
  exec accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
    --dynamo_backend no scripts/finetune.py configs/tiny.yaml "$@"
fi
python scripts/finetune.py configs/tiny.yaml --check --world-size 2 training.device=cpu "$@"
exec accelerate launch --config_file configs/accelerate/cpu-2proc.yaml scripts/finetune.py configs/tiny.yaml \
  training.device=cpu "$@"
