"""Run the documentation's Python snippets as files, in order, in one launch of ``torchrun`` (each process
runs every file; tests/test_docs.py starts it).

    torchrun --nproc_per_node 2 tests/doc_runner.py SNIPPET_DIR MODEL_DIR OUT_DIR

Each ``*.py`` file of SNIPPET_DIR runs as ``__main__`` (``runpy.run_path``) with the names the pages say
their snippets assume (:func:`doc_snippets.namespace`: ``MODEL``, ``OUT``, ``dataset``, ...) and nothing
else: no process group unless the snippet (or the Trainer, TRL, accelerate it calls) starts one, as in a
fresh process under the launcher. Between files the process is reset to that state: the patch undone, a
process group the snippet left destroyed, accelerate's state and the sequence-parallel groups forgotten,
and a new rendezvous port, as each file had a ``torchrun`` of its own.
Each rank writes ``rank<R>.json`` into OUT_DIR: per file, the error it raised (or null), the seconds it
took and, for the test to compare across ranks, the sum of the weights of a ``model`` it leaves and of
its ``logits``.
"""

from __future__ import annotations

import datetime
import json
import os
import runpy
import socket
import sys
import time
import traceback
from pathlib import Path

from doc_snippets import namespace


def _reset() -> None:
    """What a fresh process under the launcher has: nothing patched, no process group, no state."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState

    import lightseq_hf
    from lightseq_hf.parallel.groups import release_groups

    lightseq_hf.unpatch()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    release_groups()
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def _fresh_rendezvous(agent, rank: int, index: int) -> None:
    """Point ``MASTER_PORT`` at a new free port for the next file, as a fresh ``torchrun`` would (the
    default group cannot start twice through the launcher's store: the first group's keys are still
    there). Rank 0 finds the port and hosts the next group's store; the launcher's store carries the port
    to the others."""
    key = f"doc_runner/port/{index}"
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            agent.set(key, str(s.getsockname()[1]))
    os.environ["MASTER_PORT"] = agent.get(key).decode()
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def _sums(ns: dict) -> dict[str, float]:
    import torch

    out = {}
    model = ns.get("model")
    if isinstance(model, torch.nn.Module):
        out["weights"] = sum(float(p.detach().double().sum()) for p in model.parameters())
    if isinstance(ns.get("logits"), torch.Tensor):
        out["logits"] = float(ns["logits"].double().sum())
    return out


def main(snippets: Path, model_dir: str, out_dir: str) -> None:
    from torch.distributed import TCPStore

    rank = int(os.environ["RANK"])
    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=120))
    results = {}
    for index, path in enumerate(sorted(snippets.glob("*.py"))):
        _fresh_rendezvous(agent, rank, index)
        tic = time.perf_counter()
        error, sums = None, {}
        try:
            ns = runpy.run_path(str(path), init_globals=namespace(model_dir, out_dir), run_name="__main__")
            sums = _sums(ns)
        except BaseException:  # noqa: BLE001 - SystemExit too: a snippet must not end the process
            error = traceback.format_exc()[-3000:]
        results[path.name] = {"error": error, "seconds": round(time.perf_counter() - tic, 1), **sums}
        try:
            _reset()
        except Exception:  # noqa: BLE001 - a group left broken by a failed snippet: the next one says so
            results[path.name]["reset"] = traceback.format_exc()[-2000:]
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3])
