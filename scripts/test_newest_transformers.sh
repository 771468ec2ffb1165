#!/usr/bin/env bash
# The CPU test suite against the newest Transformers 5.x release, in its own environment (.venv-newest/), so
# the pinned one (.venv/, constraints.txt) stays as it is. The other packages keep their tested versions where
# the new release accepts them. Extra arguments go to pytest, e.g.
#   bash scripts/test_newest_transformers.sh tests/test_patch_llama.py tests/test_checkpointing.py
# The support table (docs/models.md, tests/test_architectures.py) lists the model types of the pinned
# release: a newer one may add types there, which that test names.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-newest/bin/python ]; then
  python3 -m venv .venv-newest
fi
. .venv-newest/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0"
fi
grep -v '^transformers==' constraints.txt > .venv-newest/constraints-newest.txt
python -m pip install -q -c .venv-newest/constraints-newest.txt -e ".[dev]"
python -m pip install -q --upgrade "transformers>=5,<6"
python -c "import transformers; print(f'transformers {transformers.__version__}')"
ruff check .
python -m pytest -q "$@"
