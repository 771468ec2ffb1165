#!/usr/bin/env bash
# Create .venv (once) and install torch 2.13 (CPU build where no GPU torch is wanted) and the project.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0"
fi
python -m pip install -q -e ".[dev]"
