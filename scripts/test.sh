#!/usr/bin/env bash
# Set up (if needed) and run the whole CPU test suite: lint, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
ruff check .
python -m pytest -q "$@"
