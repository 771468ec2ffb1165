"""What a run reads and writes in ``output_dir``: the resume choice, protection of a previous run, the
metrics file, the summary and the loss plot. JSON written here is strict (no NaN or Infinity)."""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from .config import RESUME_LATEST, RESUME_LATEST_OR_FRESH, FinetuneConfig
from .errors import ConfigError
from .log import logger
from .saving import CheckpointError, checkpoint_step, find_latest_checkpoint, verify_checkpoint

__all__ = ["LOCK_FILE", "MetricsWriter", "plot_metrics", "prepare_output_dir", "read_summary",
           "release_output_dir_locks", "write_json"]

_RUN_FILES = ("summary.json", "loss.png", "config.json")


def _strict_json(record: dict) -> dict:
    """``record`` with every non-finite float replaced by null; the replaced values are listed under
    ``nonfinite`` (``{"loss": "nan"}``), so strict JSON parsers read the file and nothing is lost."""
    out, bad = {}, {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            out[key], bad[key] = None, str(value)
        else:
            out[key] = value
    if bad:
        out["nonfinite"] = bad
    return out


def write_json(path: Path, data: dict) -> None:
    """``data`` as indented strict JSON (non-finite floats as null, see :func:`_strict_json`)."""
    path.write_text(json.dumps(_strict_json(data), indent=2, allow_nan=False))


def _existing_run(out_dir: Path, metrics_file: str) -> list[Path]:
    """What a previous run left in ``out_dir`` (metrics, summary, checkpoints, interrupted saves)."""
    found = [p for p in (out_dir / metrics_file, out_dir / "summary.json") if p.exists()]
    found += sorted(p for p in out_dir.glob("checkpoint-*") if checkpoint_step(p) is not None)
    found += sorted(out_dir.glob(".checkpoint-*.tmp"))
    return found


def _check_writable(out_dir: Path, dry_run: bool) -> None:
    """ConfigError unless ``out_dir`` can be created and written (``dry_run``: a probe file is written
    and removed in it or in its nearest existing parent; nothing stays)."""
    try:
        if dry_run:
            parent = next(p for p in (out_dir, *out_dir.absolute().parents) if p.exists())
            if not parent.is_dir():
                raise NotADirectoryError(f"{parent} is not a directory")
        else:
            parent = out_dir
            out_dir.mkdir(parents=True, exist_ok=True)
        probe = parent / f".write-test-{os.getpid()}"
        probe.write_text("ok")  # permissions alone do not say it (root, read-only mounts, /proc)
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"output_dir: cannot write to {out_dir} ({e.strerror or e}); choose a writable "
                          "directory") from None


LOCK_FILE = ".lightseq-run.lock"
_held_locks: dict[Path, int] = {}


def _lock_output_dir(out_dir: Path, dry_run: bool) -> None:
    """One run at a time in ``out_dir``: an exclusive lock on its lock file, held until the run ends
    (:func:`release_output_dir_locks`, called however it ends; the system releases the lock when the
    process dies, and a file left by a killed process locks nothing). ConfigError, naming the holder, when
    another process holds it; ``dry_run`` only tests it."""
    try:
        import fcntl
    except ImportError:  # no advisory locks on this platform
        return
    key = out_dir.resolve()
    path = out_dir / LOCK_FILE
    if key in _held_locks or (dry_run and not path.exists()):
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 300).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise ConfigError(f"output_dir {out_dir} is in use by a run that has not ended ({holder}); wait for "
                          "it or stop it, or choose another output_dir") from None
    if dry_run:
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.write(fd, f"process {os.getpid()} on {platform.node()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}"
             .encode())
    if not _held_locks:
        atexit.register(release_output_dir_locks)  # an exit through the interpreter's end
    _held_locks[key] = fd


def release_output_dir_locks() -> None:
    """Remove the lock files this process holds, then release their locks (the end of its runs)."""
    for key, fd in list(_held_locks.items()):
        with contextlib.suppress(OSError):  # removed while still locked: no other run can take it between
            os.unlink(key / LOCK_FILE)
        with contextlib.suppress(OSError):
            os.close(fd)
        del _held_locks[key]


def _find_resume(cfg: FinetuneConfig, out_dir: Path, dry_run: bool) -> Path | None:
    s = cfg.saving
    if s.resume_from not in (RESUME_LATEST, RESUME_LATEST_OR_FRESH):
        if s.resume_from is None:
            return None
        resume = Path(s.resume_from)
        verify_checkpoint(resume, s.checksums)
        return resume
    resume, skipped = find_latest_checkpoint(out_dir, s.checksums, require="state")
    for reason in skipped if not dry_run else ():
        logger.warning(f"skipped {reason}")
    if resume is None and s.resume_from == RESUME_LATEST:
        why = f" ({len(skipped)} skipped: {'; '.join(skipped)})" if skipped else ""
        raise ConfigError(
            f"saving.resume_from=latest: no complete checkpoint with training state in {out_dir}{why}. "
            "Pass a checkpoint path, or saving.resume_from=latest_or_fresh to start from step 0 when "
            "there is none"
        )
    if resume is None and not dry_run:
        logger.info(f"saving.resume_from=latest_or_fresh: no complete checkpoint in {out_dir}; starting "
                    "from step 0")
    return resume


def _protect_previous_run(cfg: FinetuneConfig, out_dir: Path, dry_run: bool) -> None:
    """Refuse to start in a directory that holds a run, or move that run into ``previous-<time>/``."""
    previous = _existing_run(out_dir, cfg.logging.metrics_file)
    s = cfg.saving
    if not previous:
        return
    if not (s.if_output_exists == "archive" or s.resume_from == RESUME_LATEST_OR_FRESH):
        names = ", ".join(p.name for p in previous[:4]) + (", ..." if len(previous) > 4 else "")
        raise ConfigError(
            f"output_dir {out_dir} already holds a run ({names}). Resume it with saving.resume_from=latest, "
            "choose another output_dir, or set saving.if_output_exists=archive to move the old run into a "
            "subdirectory"
        )
    if dry_run:
        return
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    archive = out_dir / f"previous-{stamp}"
    while archive.exists():
        archive, n = out_dir / f"previous-{stamp}-{n}", n + 1
    archive.mkdir()
    for p in previous + [out_dir / name for name in _RUN_FILES if (out_dir / name).exists()]:
        if p.exists():
            shutil.move(str(p), str(archive / p.name))
    logger.info(f"moved the previous run (nothing to resume from) to {archive}")


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def prepare_output_dir(cfg: FinetuneConfig, dry_run: bool = False) -> Path | None:
    """Check ``output_dir`` is writable and no other run is using it (and lock it for this one), pick the
    checkpoint to resume from, protect a previous run.

    Returns the checkpoint directory to load (verified complete and intact) or None for a fresh
    start. A checkpoint outside ``output_dir`` (another run's) is refused unless
    ``saving.resume_other_run``; then ``output_dir`` is treated as for a fresh start and the choice is
    logged. Raises ConfigError or CheckpointError naming the problem. Main process only; ``dry_run``
    checks the same without creating, moving or logging anything.
    """
    out_dir = Path(cfg.output_dir)
    _check_writable(out_dir, dry_run)
    _lock_output_dir(out_dir, dry_run)
    resume = _find_resume(cfg, out_dir, dry_run)
    if resume is not None and not (resume / "state").is_dir():
        raise CheckpointError(
            f"{resume} holds weights only (saved with saving.save_optimizer=false): there is no state/ to "
            f"resume from. Start a new run from its weights with model.path={resume}"
        )
    other_run = resume is not None and not _same_dir(resume.parent, out_dir)
    if other_run and not cfg.saving.resume_other_run:
        raise ConfigError(
            f"saving.resume_from: {resume} belongs to another run ({resume.parent}), not to output_dir "
            f"{out_dir}. Continue that run with output_dir={resume.parent} saving.resume_from=latest, or set "
            "saving.resume_other_run=true to start this run from its state"
        )
    if resume is None or other_run:
        _protect_previous_run(cfg, out_dir, dry_run)
    if other_run and not dry_run:
        logger.info(f"saving.resume_other_run=true: resuming from {resume}, a checkpoint of another run "
                    f"({resume.parent}); this run's metrics and checkpoints go to {out_dir}")
    return resume


class MetricsWriter:
    """Metrics as strict JSON lines (main process only: ``path`` None elsewhere). Resuming keeps the
    records up to the resumed step; later ones (steps that will run again) are first copied to
    ``<metrics>.before-resume-<step>``."""

    def __init__(self, path: Path | None, keep_until_step: int | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)  # logging.metrics_file may name a subdirectory
        if path is None or not path.exists():
            return
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if keep_until_step is None:  # prepare_output_dir moved or refused a previous run
            raise RuntimeError(f"{path} exists on a fresh start")
        kept = []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut short by a crash
                continue
            if rec.get("step", 0) <= keep_until_step:
                kept.append(line)
        if len(kept) < len(lines):
            backup = path.with_name(f"{path.name}.before-resume-{keep_until_step}")
            shutil.copyfile(path, backup)
            logger.info(f"{len(lines) - len(kept)} metrics records after step {keep_until_step} (they run "
                        f"again) are kept in {backup}")
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)

    def write(self, record: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(_strict_json(record), allow_nan=False) + "\n")


def plot_metrics(metrics_path: Path, png_path: Path, title: str = "") -> None:
    """Loss curve (and retrieval accuracy with its chance level, when logged) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in recs if r.get("kind") == "train" and r.get("loss") is not None]
    evals = [r for r in recs if r.get("kind") == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], color="tab:blue", lw=1,
            label="train loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss", color="tab:blue")
    if evals:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", color="tab:red",
                 label="retrieval accuracy")
        ax2.axhline(evals[-1]["chance"], color="tab:red", ls="--", lw=1, label="chance")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("retrieval accuracy (held-out)", color="tab:red")
        ax2.legend(loc="center right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def read_summary(out_dir: Path) -> dict[str, Any] | None:
    """The ``summary.json`` a finished run left, or None."""
    try:
        return json.loads((out_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
