"""Make the shared test helpers (tests/distributed.py) importable from every test folder; without a GPU,
Triton kernels run in Triton's interpreter (set before any test imports triton, whatever the order)."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
