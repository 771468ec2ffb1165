"""The documented multi-node launch, as two ``torchrun`` agents on this machine.

docs/multi-gpu.md's ``multinode-demo`` block is run twice at the same time, as two "nodes" of one CPU
process each, joined by a c10d rendezvous on 127.0.0.1 and a free port: the tiny model fine-tunes for a
few steps. Asserted: both agents exit 0, the losses are finite, the run was 1 data-parallel x 2
sequence-parallel, and, seen from the test side (a ``sitecustomize`` that records every point-to-point
batch the workers post), each node's worker exchanged attention blocks of its 2048-token shard with the
worker of the other node.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from doc_snippets import ROOT, all_snippets, commands, split_command

from lightseq_hf._testing.faults import ENV as FAULTS_ENV

pytestmark = pytest.mark.slow

PROBE = '''
import json, os
if os.environ.get("DOCS_TEST_P2P_PROBE") and "RANK" in os.environ:
    import torch.distributed as dist

    _posted, _original = [], dist.batch_isend_irecv

    def _dump():  # after every post: workers end with os._exit, which runs no exit handlers
        record = {k: os.environ.get(k) for k in ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE")}
        record["posted"] = _posted
        path = os.path.join(os.environ["DOCS_TEST_P2P_PROBE"], f"rank{os.environ['RANK']}.json")
        with open(path, "w") as f:
            json.dump(record, f)

    def _recording(ops):
        for op in ops:
            _posted.append([op.op.__name__, int(op.peer), list(op.tensor.shape)])
        _dump()
        return _original(ops)

    dist.batch_isend_irecv = _recording
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _documented_command(port: int, out_dir: Path) -> list[str]:
    (block,) = [s for s in all_snippets() if s.marker == "multinode-demo"]
    (command,) = commands(block.code)
    tokens = split_command(command)
    assert tokens[0] == "torchrun" and "--nnodes" in tokens and tokens[tokens.index("--nnodes") + 1] == "2"
    assert tokens[tokens.index("--rdzv_backend") + 1] == "c10d"
    endpoint = tokens.index("--rdzv_endpoint") + 1
    assert tokens[endpoint].startswith("127.0.0.1:")
    tokens[endpoint] = f"127.0.0.1:{port}"
    tokens = [f"output_dir={out_dir}" if t.startswith("output_dir=") else t for t in tokens]
    return [sys.executable, "-m", "torch.distributed.run", *tokens[1:]]


def test_two_torchrun_agents_fine_tune_sequence_parallel_across_nodes(tmp_path):
    probe_dir, site = tmp_path / "probe", tmp_path / "site"
    probe_dir.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(PROBE)
    out_dir = tmp_path / "run"
    command = _documented_command(_free_port(), out_dir)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               DOCS_TEST_P2P_PROBE=str(probe_dir),
               PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop(FAULTS_ENV, None)  # no injected faults in documented runs
    agents = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=600)[0])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out[-6000:]
    log = "".join(outputs)
    split = "world 2 = 1 data-parallel x 2 sequence-parallel; context 4096 (2048 tokens per rank)"
    assert split in log, log[-3000:]

    summary = json.loads((out_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["sp_size"], summary["dp_size"], summary["steps"]) == (2, 2, 1, 3)
    losses = [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()
              if json.loads(line).get("kind") == "train"]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and math.isfinite(summary["final_loss"])

    records = {int(r["RANK"]): r for r in (json.loads(p.read_text()) for p in probe_dir.glob("rank*.json"))}
    assert sorted(records) == [0, 1], records.keys()
    assert {records[0]["GROUP_RANK"], records[1]["GROUP_RANK"]} == {"0", "1"}, "one worker per node"
    for rank, record in records.items():
        sends = [shape for kind, peer, shape in record["posted"] if kind == "isend" and peer == 1 - rank]
        recvs = [shape for kind, peer, shape in record["posted"] if kind == "irecv" and peer == 1 - rank]
        assert sends and recvs, f"rank {rank} exchanged no attention blocks with the other node"
        assert any(len(s) == 4 and s[1] == 2048 for s in sends + recvs), record["posted"][:8]
        assert all(len(s) < 2 or s[1] <= 2048 for s in sends + recvs), "a block longer than the shard"
