"""``lightseq-finetune --nproc 2`` (CPU, gloo) when it is stopped or one rank fails, and a plain loop of
one's own when one rank crashes.

SIGTERM to the launcher (what ``kill``, ``timeout`` and batch schedulers send) and Ctrl-C (SIGINT to the
terminal's whole process group) stop both workers and leave one line, exit status 128 + signal. When one
rank fails (a crash of its own, a full disk during a save: a file size limit makes the write fail) the
other says which rank failed and why, in one line, instead of the backend's "Connection closed by peer".
However the run ends, its lock file in ``output_dir`` is removed.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightseq_hf._testing.faults import ENV as FAULTS_ENV
from lightseq_hf.training.output import LOCK_FILE

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["training.device=cpu", "logging.progress_bar=false", "data.synthetic.eval_samples=2",
         "context_length=256", "model.config.max_position_embeddings=256", "logging.plot=false"]

pytestmark = pytest.mark.slow


def _env(fault: str | None = None) -> dict[str, str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop(FAULTS_ENV, None)
    if fault:
        env[FAULTS_ENV] = fault
    return env


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("lightseq-finetune:")]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_a_stopped_launcher_stops_its_workers_with_one_line(tmp_path: Path, how: str) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "lightseq_hf.training.cli", "--nproc", "2",
                             "configs/tiny.yaml", *SMALL, "training.max_steps=100000", f"output_dir={run}"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 150
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").stat().st_size):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.5)
    workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    assert len(workers) == 2
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)  # the launcher only, as `kill` or `timeout` would
    else:
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the group
    out, _ = proc.communicate(timeout=60)
    signum = signal.SIGTERM if how == "sigterm" else signal.SIGINT
    assert proc.returncode == 128 + signum, out[-3000:]
    assert _lines(out) == [f"lightseq-finetune: stopped by {signum.name}; every worker has exited (resume "
                           "the run with saving.resume_from=latest)"], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not any(_alive(pid) for pid in workers)  # nothing keeps training into the output directory
    assert not (run / LOCK_FILE).exists()


def _file_size_limit(limit: int | None):
    """A ``preexec_fn`` capping the size of every file the processes write (a disk that fills up: the
    write past it fails, as it does when the disk is full; Python ignores the SIGXFSZ that comes with it)."""
    if limit is None:
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.parametrize(("fault", "limit", "failed", "reason"), [
    ("step:1:2:raise", None, "rank 1 stopped: ValueError: injected failure (step point, step 2)",
     "stopped on rank 0: rank 1 failed: ValueError: injected failure (step point, step 2)"),
    # the optimizer state (about 1 MB) does not fit: torch's writer fails in the middle of state/
    (None, 600_000, "stopped: writing checkpoint-2 in {run} failed (RuntimeError: [enforce fail at ",
     "stopped on rank 1: rank 0 failed: CheckpointError: writing checkpoint-2"),
])
def test_the_other_rank_names_the_failed_rank_and_why(tmp_path: Path, fault: str | None, limit: int | None,
                                                      failed: str, reason: str) -> None:
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lightseq_hf._testing.faults", "--nproc", "2",
                           "configs/tiny.yaml", *SMALL, "training.max_steps=4", "saving.every=2",
                           f"output_dir={run}"], cwd=ROOT, env=_env(fault), capture_output=True,
                          text=True, timeout=240, preexec_fn=_file_size_limit(limit))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    lines = _lines(out)
    assert len(lines) == 2, out[-3000:]  # the failed rank's line, and its peer's naming it
    assert any(failed.format(run=run) in line for line in lines), lines
    assert any(reason in line for line in lines), lines
    assert "Traceback" not in out and "Connection closed" not in out, out[-3000:]
    assert not (run / LOCK_FILE).exists()  # the run's lock file goes with the run
    for notice in ("attention implementation 'sdpa' -> 'lightseq_dist'", "training.warmup_steps=10 exceeds"):
        assert out.count(notice) == 1, out[-3000:]  # the same on every rank: printed by rank 0 alone
    if limit is not None:
        assert any("the checkpoints saved before are intact" in line and "saving.resume_from=latest" in line
                   for line in lines), lines


PLAIN_LOOP = """
import sys
sys.path.insert(0, {tests!r})
import torch.distributed as dist
import lightseq_hf
from tiny_models import make_batch, make_model

dist.init_process_group("gloo")
model = lightseq_hf.patch(make_model(layers=1))
for step in range(3):
    ids, labels = make_batch(1, 16, step)
    if step == 1 and dist.get_rank() == 1:
        raise ValueError("the data loader of rank 1 broke")
    model(input_ids=ids, labels=labels).loss.backward()
    lightseq_hf.sync_gradients(model)
"""


def test_a_crash_on_one_rank_of_a_plain_loop_is_named_by_the_other(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(PLAIN_LOOP.format(tests=str(ROOT / "tests")))
    port = 20000 + os.getpid() % 20000
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(
        _env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs
    assert "ValueError: the data loader of rank 1 broke" in outs[1]  # its own traceback, as usual
    named = [line.split("lightseq_hf: ", 1)[1] for line in outs[0].splitlines()
             if "lightseq_hf: rank 0:" in line]
    assert named == ["rank 0: a collective could not complete: rank 1 failed: ValueError: the data loader "
                     "of rank 1 broke"], outs[0][-3000:]  # torch may prefix the line with [rank0]
    assert "Traceback" not in outs[0], outs[0][-3000:]
