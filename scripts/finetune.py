"""Sequence-parallel fine-tuning from a YAML config.

    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml scripts/finetune.py configs/tiny.yaml \
        training.max_steps=20 output_dir=runs/try
"""

import sys

from lightseq_hf.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
