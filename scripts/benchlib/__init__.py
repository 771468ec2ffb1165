"""The benchmark harness shared by ``scripts/bench_*.py``.

- :mod:`.launch`: process group and device of a ``torchrun`` (or a test's) process.
- :mod:`.timing`: median milliseconds (CUDA events or the host clock, warm-up, slowest rank; the
  profiler's kernel time), peak memory, per-rank values, attention FLOPs (``lightseq_hf.metrics``'
  count), the measured bf16 matmul rate.
- :mod:`.exactness`: relative errors against references, agreement of all ranks.
- :mod:`.results`: results files (device, date, versions; rewritten after every row), failures as rows.
- :mod:`.plots`: matplotlib without a display.
- :mod:`.peers`: what ours is compared with (torch context parallel, the all-gather varlen ring) and the
  attention runners the timings call.
- :mod:`.ablations`: transfer modes of the attention loop (serial transfers, compute only), installed
  over ``PeerComm`` by the benchmarks.
- :mod:`.workloads`: document-length mixes and the Llama model shapes of the step benchmarks.

A script of ``scripts/`` imports it as ``benchlib``: run as a script, its folder is ``sys.path[0]``;
loaded by path (the tests), each ``bench_*.py`` first puts its folder on ``sys.path``. Importing it puts
the checkout's root first on ``sys.path``, so a script run from a checkout that was never installed (the
GPU machines) imports this checkout's ``lightseq_hf``.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
