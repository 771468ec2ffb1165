"""What ``lightseq-finetune`` says when a run cannot start, and what a run in one process says.

In process: an unknown key suggests the key meant; a metrics file outside ``output_dir`` and a timeout
too short to start are refused in one line; ``--nproc`` makes ``--check``'s checks (the model the patch
refuses, an output directory that cannot be written, a resume in another data order) before it starts any
worker; a process group that does not start in time names ``training.timeout_s``, a port in use names the
port. One single-process run of the fine-tune: one "nothing is split" notice, no CUDA allocator line on
the CPU, no lock file left.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightseq_hf.training import cli
from lightseq_hf.training.output import LOCK_FILE
from lightseq_hf.training.processes import launch

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = ["training.device=cpu", "logging.progress_bar=false", "logging.plot=false", "context_length=256",
         "model.config.max_position_embeddings=256", "data.synthetic.eval_samples=2"]


def _one_line(capsys, code: int, argv: list[str]) -> str:
    assert cli.main(argv) == code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def test_config_mistakes_are_one_line_with_the_fix(tmp_path: Path, capsys) -> None:
    out = f"output_dir={tmp_path / 'run'}"
    line = _one_line(capsys, 2, [TINY, out, "training.learning_rate=1e-3", "logging.evry=2", "--check"])
    assert "unknown key training.learning_rate; did you mean training.lr?" in line
    assert "unknown key logging.evry; did you mean logging.every?" in line
    line = _one_line(capsys, 2, [TINY, out, "logging.metrics_file=/dev/full", "--check"])
    assert "logging.metrics_file: '/dev/full' is not inside output_dir" in line and "relative" in line
    line = _one_line(capsys, 2, [TINY, out, "logging.metrics_file=../m.jsonl", "--check"])
    assert "is not inside output_dir" in line
    line = _one_line(capsys, 2, [TINY, out, "training.timeout_s=0.01", "--check"])
    assert "training.timeout_s: input should be greater than or equal to 1; got 0.01" in line


def test_the_launcher_checks_before_it_starts_workers(tmp_path: Path, capsys, monkeypatch) -> None:
    started = []
    monkeypatch.setattr(launch, "launch", lambda *a, **k: started.append(a) or 0)
    mamba = "model.config={model_type: mamba, vocab_size: 256, hidden_size: 64, num_hidden_layers: 2}"
    for overrides, needle in (
        ([mamba], "config error: model: lightseq_hf cannot patch MambaForCausalLM"),
        (["output_dir=/proc/lightseq-run"], "config error: output_dir: cannot write to /proc/lightseq-run"),
    ):
        argv = ["--nproc", "2", TINY, *SMALL, f"output_dir={tmp_path / 'r'}", *overrides]
        line = _one_line(capsys, 2, argv)
        assert needle in line and not line.endswith("..."), line
    assert started == []  # refused before any worker
    assert cli.main(["--nproc", "2", TINY, *SMALL, f"output_dir={tmp_path / 'ok'}"]) == 0
    assert len(started) == 1 and not (tmp_path / "ok").exists()  # the checks create nothing


def test_start_up_failures_name_the_timeout_or_the_port(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    for error in (RuntimeError("wait timeout after 1500ms, keys: /default_pg/0//cpu//0/1"),
                  RuntimeError("Gloo connectFullMesh failed with [pair.h:311] Connect timeout [none]")):
        assert cli.worker_failed(error, timeout_s=1.5) == 2
        line = capsys.readouterr().err.strip()
        assert "did not all join the process group within training.timeout_s=1.5 s" in line, line
        assert "Raise training.timeout_s" in line and "\n" not in line
    busy = RuntimeError("The server socket has failed to listen on any local network address. port: 29533, "
                        "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    assert cli.worker_failed(busy, timeout_s=600.0) == 2
    line = capsys.readouterr().err.strip()
    assert "port 29533 of 127.0.0.1 is in use" in line and "lightseq-finetune --nproc N" in line, line


@pytest.mark.slow
def test_a_run_in_one_process_says_nothing_is_split_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "scripts/finetune.py", TINY, *SMALL, "sp_size=null", "training.max_steps=2",
               "training.warmup_steps=0", f"output_dir={run}"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert out.count("one process, so nothing is split") == 1, out[-3000:]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in out, out[-3000:]  # a CPU run
    assert (run / "summary.json").is_file() and not (run / LOCK_FILE).exists()
