#!/usr/bin/env bash
# Create .venv (once) and install torch 2.13 (CPU build where no GPU torch is wanted) and the project with its
# dev extra (the training extra, triton and the test tools).
# The project install is skipped when pyproject.toml and the Python version are unchanged since the last
# successful one (a stamp in .venv); delete .venv/.lightseq-installed to force it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.lightseq-installed
want="$(python -c 'import hashlib, sys; print(hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest(), sys.version.split()[0])')"
# the core, the training extra and the test tools (pip install -e ".[dev]" brings all three)
check="import torch, lightseq_hf, lightseq_hf.training.config, datasets, tqdm, matplotlib, pytest, triton"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c "$check" 2>/dev/null; then
  exit 0
fi
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
