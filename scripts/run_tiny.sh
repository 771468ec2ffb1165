#!/usr/bin/env bash
# The main job: sequence-parallel fine-tune of a tiny random-init Llama on the synthetic passkey task
# (configs/tiny.yaml), 2 processes. On a machine with 2+ GPUs it runs on 2 GPUs (NCCL), otherwise on 2 CPU
# processes (gloo). Extra arguments are config overrides, e.g. `bash scripts/run_tiny.sh training.max_steps=20`.
# `--nproc 2` checks the config (and output_dir) before it starts the processes: a mistake prints one line
# and exits with 2; an error a process finds later is one line too.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
gpus=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$gpus" -ge 2 ]; then
  exec python scripts/finetune.py --nproc 2 configs/tiny.yaml "$@"
fi
exec python scripts/finetune.py --nproc 2 configs/tiny.yaml training.device=cpu "$@"
