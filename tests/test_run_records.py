"""What a run's records vouch for: a completion record must list every file, another run's checkpoint is
refused unless asked for, a finished run resumed changes nothing, and an error found after the launch is
one line."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lightseq_hf.training.config import ConfigError, config_from_dict

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())


def test_completion_record_must_list_every_file(tmp_path: Path) -> None:
    from lightseq_hf.training.saving import (
        COMPLETION_RECORD,
        CheckpointError,
        find_latest_checkpoint,
        verify_checkpoint,
        write_completion_record,
    )

    ckpt = tmp_path / "checkpoint-2"
    (ckpt / "state").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(os.urandom(256))
    (ckpt / "state" / "optimizer.bin").write_bytes(os.urandom(256))
    write_completion_record(ckpt, 2)
    verify_checkpoint(ckpt)
    record = json.loads((ckpt / COMPLETION_RECORD).read_text())
    (ckpt / COMPLETION_RECORD).write_text(json.dumps({**record, "files": {}}))
    with pytest.raises(CheckpointError, match="lists no files, so it vouches for nothing"):
        verify_checkpoint(ckpt)
    assert find_latest_checkpoint(tmp_path, require="state")[0] is None
    del record["files"]["state/optimizer.bin"]  # a record that misses one file
    (ckpt / COMPLETION_RECORD).write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="state/optimizer.bin is not in its checkpoint_complete.json"):
        verify_checkpoint(ckpt)


def test_another_runs_checkpoint_is_refused_unless_asked(tmp_path: Path, caplog) -> None:
    from lightseq_hf.training.output import prepare_output_dir
    from lightseq_hf.training.saving import publish, write_completion_record

    tmp = tmp_path / "a" / ".checkpoint-2.tmp"
    (tmp / "state").mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"w" * 64)
    (tmp / "state" / "optimizer.bin").write_bytes(b"o" * 64)
    write_completion_record(tmp, 2)
    ckpt = tmp_path / "a" / "checkpoint-2"
    publish(tmp, ckpt)
    b = tmp_path / "b"
    b.mkdir()
    (b / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')  # run B's own history

    def cfg(*extra: str):
        return config_from_dict(TINY, [f"output_dir={b}", f"saving.resume_from={ckpt}", *extra],
                                base_dir=ROOT / "configs")

    with pytest.raises(ConfigError, match=f"saving.resume_from: {ckpt} belongs to another run .*not to "
                                          f"output_dir {b}.*saving.resume_other_run=true"):
        prepare_output_dir(cfg())
    # asked for: B's own history must not be mixed with A's continuation (archive it or stop)
    with pytest.raises(ConfigError, match="already holds a run"):
        prepare_output_dir(cfg("saving.resume_other_run=true"))
    caplog.set_level("INFO", logger="lightseq_hf")
    assert prepare_output_dir(cfg("saving.resume_other_run=true", "saving.if_output_exists=archive")) == ckpt
    assert not (b / "metrics.jsonl").exists() and len(list(b.glob("previous-*/metrics.jsonl"))) == 1
    assert f"resuming from {ckpt}, a checkpoint of another run ({ckpt.parent})" in caplog.text


def _digest(root: Path) -> dict[str, str]:
    """Every file of a run but the lock file (it names the process that last held the directory)."""
    from lightseq_hf.training.output import LOCK_FILE

    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_FILE}


@pytest.mark.slow


def test_resuming_a_finished_run_changes_nothing(tmp_path: Path) -> None:
    """One process (sp_size 1): a 2-step run, then the same command with resume_from=latest."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", "lightseq_hf.training.cli", "configs/tiny.yaml", "sp_size=1",
            "training.device=cpu", "training.max_steps=2", "training.on_nonfinite=skip", f"output_dir={run}",
            "logging.progress_bar=false", "logging.plot=false", "context_length=128",
            "model.config.max_position_embeddings=128", "data.synthetic.eval_samples=2"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    first = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    before = _digest(run)
    again = subprocess.run(args + ["saving.resume_from=latest"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"nothing to do: {run / 'checkpoint-2'} is step 2 and this run has 2 steps, so the run in {run} " \
           "is finished; nothing was changed" in again.stdout, again.stdout
    assert "loss nan" not in again.stdout and "Traceback" not in again.stderr
    assert _digest(run) == before  # no re-save, no moved checkpoint, no new eval row, same summary
    summary = (run / "summary.json").read_text()
    json.loads(summary, parse_constant=lambda c: pytest.fail(f"summary.json holds {c}"))


@pytest.mark.slow


def test_error_found_after_the_launch_is_one_line(tmp_path: Path) -> None:
    """``lightseq-finetune --nproc 2``: a config error only the workers can find (the dataset is smaller
    than a batch) prints one line and exits 2, with no launcher traceback."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "scripts/finetune.py", "--nproc", "2", "configs/tiny.yaml",
                           "training.device=cpu", "data.synthetic.num_samples=1", "training.batch_size=2",
                           "context_length=128", "model.config.max_position_embeddings=128",
                           f"output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line
             and not line.startswith("  warnings.warn")]
    assert lines == ["lightseq-finetune: config error: training.batch_size 2 exceeds the 1 samples each of "
                     "the 1 data-parallel groups has; lower training.batch_size or add data"], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
