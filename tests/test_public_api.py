"""The public surface of ``lightseq_hf`` and the core import without the training extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightseq_hf

ROOT = Path(__file__).resolve().parents[1]


def test_all_lists_the_public_surface():
    assert sorted(lightseq_hf.__all__) == sorted({
        "ParallelGroups", "Segments", "build_schedule", "current_groups", "dist_flash_attn",
        "init_sequence_parallel", "pad_to_multiple", "patch", "patch_llama", "patch_model",
        "remat_checkpoint", "segments_from_hf", "unpatch", "unpatch_llama", "ParityCallback", "ParityError",
        "check_parity", "sync_gradients",
    })
    for name in lightseq_hf.__all__:
        assert getattr(lightseq_hf, name) is not None


def test_core_imports_without_the_train_extra():
    """pydantic, datasets, tqdm, matplotlib and yaml blocked (``sys.modules[name] = None``): the package, its
    kernels, the parallel layer and the patches import, and one attention call runs."""
    blocked = ("pydantic", "datasets", "tqdm", "matplotlib", "yaml")
    code = (
        f"import sys\nfor m in {blocked!r}:\n    sys.modules[m] = None\n"
        "import torch, lightseq_hf, lightseq_hf.kernels, lightseq_hf.parallel, lightseq_hf.patches\n"
        "import lightseq_hf.checkpoint, lightseq_hf.offload, lightseq_hf.planner, lightseq_hf.memory\n"
        "q = torch.randn(1, 8, 2, 16)\n"
        "assert lightseq_hf.dist_flash_attn(q, q, q).shape == q.shape\n"
        "try:\n    import lightseq_hf.training.config\n"
        "except ImportError:\n    print('training needs the extra')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "training needs the extra" in done.stdout  # the block really applies
