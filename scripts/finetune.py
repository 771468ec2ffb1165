"""Sequence-parallel fine-tuning from a YAML config (the ``lightseq-finetune`` command).

    python scripts/finetune.py --nproc 2 configs/tiny.yaml training.max_steps=20 output_dir=runs/try
    accelerate launch --config_file configs/accelerate/cpu-2proc.yaml scripts/finetune.py configs/tiny.yaml
"""

import sys
from pathlib import Path

try:
    import lightseq_hf  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightseq_hf.training.cli import run  # noqa: E402

if __name__ == "__main__":
    run()
