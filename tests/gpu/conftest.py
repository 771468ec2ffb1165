"""One shard of the GPU tests when ``GPU_TESTS_SHARD=I/N`` is set (``scripts/run_gpu_tests.sh --shard I/N``
sets it, and ``GPU_TESTS_GPUS`` when ``--gpus`` is given): the tests of the other shards are deselected
(``tests/gpu/shards.py`` plans the shards from ``tests/gpu/durations.tsv``). A test the table does not list
runs in the last shard. Modules that skip on this machine skip as they do in a whole run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import shards  # noqa: E402


def pytest_collection_modifyitems(config, items) -> None:
    which = os.environ.get("GPU_TESTS_SHARD")
    if not which:
        return
    i, n = shards.parse_shard(which)
    gpus = int(os.environ.get("GPU_TESTS_GPUS") or shards.detected_gpus())
    table = shards.load()
    known = {t.node for t in table}
    mine = {t.node for t in shards.plan(table, n, gpus)[i - 1]}
    keep, drop = [], []
    for item in items:
        row = item.nodeid if item.nodeid in known else item.nodeid.split("[")[0]
        (keep if row in mine or (row not in known and i == n) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep
