"""Crash-safe checkpoint directories: atomic publish, completion record, verification.

A checkpoint is written under ``.checkpoint-<step>.tmp`` and renamed to ``checkpoint-<step>`` only
after every rank has finished writing and the main process has written the completion record
``checkpoint_complete.json`` (step, metadata, and the size and sha256 of every file). A directory
named ``checkpoint-<step>`` without a valid record (interrupted save of an older version, or files
changed since) is never loaded: :func:`find_latest_checkpoint` skips it with a reason, and
:func:`verify_checkpoint` names the problem. Nothing here knows about models or process groups.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

__all__ = ["COMPLETION_RECORD", "CheckpointError", "checkpoint_step", "file_sha256", "find_latest_checkpoint",
           "publish", "read_completion_record", "temporary_path", "verify_checkpoint",
           "write_completion_record"]

COMPLETION_RECORD = "checkpoint_complete.json"
_NAME = re.compile(r"checkpoint-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint that must not be loaded (incomplete, truncated or corrupt); names the file."""


def checkpoint_step(path: str | Path) -> int | None:
    """The step of a ``checkpoint-<step>`` directory name, else None."""
    m = _NAME.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def temporary_path(out_dir: str | Path, step: int) -> Path:
    """Where checkpoint ``step`` is written before it is published (hidden from ``checkpoint-*``)."""
    return Path(out_dir) / f".checkpoint-{step}.tmp"


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != COMPLETION_RECORD)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_completion_record(directory: str | Path, step: int, meta: dict | None = None,
                            checksums: bool = True) -> dict:
    """Record every file of ``directory`` (size, and sha256 when ``checksums``) as complete."""
    root = Path(directory)
    files = {}
    for p in _files(root):
        with open(p, "rb") as f:  # flush the file's data to disk before it is declared complete
            os.fsync(f.fileno())
        entry: dict[str, Any] = {"size": p.stat().st_size}
        if checksums:
            entry["sha256"] = file_sha256(p)
        files[p.relative_to(root).as_posix()] = entry
    record = {"step": step, "written": time.strftime("%Y-%m-%dT%H:%M:%S"), "meta": meta or {}, "files": files}
    _write_json_atomic(root / COMPLETION_RECORD, record)
    return record


def read_completion_record(directory: str | Path) -> dict:
    """The completion record, or CheckpointError saying why there is none."""
    root = Path(directory)
    path = root / COMPLETION_RECORD
    if not path.is_file():
        raise CheckpointError(
            f"{root} is incomplete: it has no {COMPLETION_RECORD} (its save was interrupted, or it was "
            "written by an older version that did not record completion)"
        )
    try:
        record = json.loads(path.read_text())
        record["files"], record["step"]  # noqa: B018 - both keys must be there
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e}); the checkpoint cannot be trusted") from None
    return record


def verify_checkpoint(directory: str | Path, checksums: bool = True) -> dict:
    """Check the record lists every file of the directory and each is present with its size (and
    sha256); return the record.

    Raises CheckpointError naming the first missing, unlisted, truncated or changed file.
    """
    root = Path(directory)
    record = read_completion_record(root)
    files = record["files"]
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{root / COMPLETION_RECORD} lists no files, so it vouches for nothing; the "
                              "checkpoint cannot be trusted")
    unlisted = sorted({p.relative_to(root).as_posix() for p in _files(root)} - set(files))
    if unlisted:
        raise CheckpointError(
            f"{root} is damaged: {unlisted[0]} is not in its {COMPLETION_RECORD} (a file added after the "
            "save, or a record that was edited); the checkpoint cannot be trusted")
    for rel, entry in files.items():
        p = root / rel
        if not p.is_file():
            raise CheckpointError(f"{root} is damaged: {rel} is missing")
        size = p.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"{root} is damaged: {rel} has {size} bytes but {entry['size']} were written (truncated "
                "or changed since the save)"
            )
        if checksums and "sha256" in entry and file_sha256(p) != entry["sha256"]:
            raise CheckpointError(
                f"{root} is damaged: {rel} does not match its recorded sha256 (the file changed since the "
                "save: disk or copy corruption)"
            )
    return record


def find_latest_checkpoint(output_dir: str | Path, checksums: bool = True,
                           require: str | None = None) -> tuple[Path | None, list[str]]:
    """The newest complete, intact ``checkpoint-<step>`` under ``output_dir`` (holding the
    subdirectory ``require``, when given) and, for every newer one passed over, the reason."""
    found = sorted(((checkpoint_step(p), p) for p in Path(output_dir).glob("checkpoint-*")
                    if p.is_dir() and checkpoint_step(p) is not None), reverse=True)
    skipped = []
    for _, path in found:
        try:
            verify_checkpoint(path, checksums)
        except CheckpointError as e:
            skipped.append(str(e))
            continue
        if require is not None and not (path / require).is_dir():
            skipped.append(f"{path} has no {require}/ (saved with saving.save_optimizer=false)")
            continue
        return path, skipped
    return None, skipped


def publish(tmp: Path, final: Path) -> Path | None:
    """Rename the finished ``tmp`` to ``final``. An existing ``final`` is moved aside (never
    deleted) to ``<final>.replaced-<time>``, whose path is returned."""
    aside = None
    if final.exists():
        aside = final.with_name(f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists():
            aside = aside.with_name(f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
            n += 1
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    return aside
