"""Results files: where they go, the run's metadata, and rows rewritten to disk as they come."""

from __future__ import annotations

import datetime
import json
import os
import re
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

#: NVLink multicast switches (off on shared machines), recorded with every multi-GPU run
MULTICAST_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")


def today() -> str:
    return datetime.date.today().isoformat()


def device_name(device: torch.device | str) -> str:
    """The GPU's name, or ``"cpu"``."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_slug(name: str, *, short: bool = False) -> str:
    """A device name in file names: ``"NVIDIA H200"`` -> ``"h200"``; ``short``: its first word only
    (``"h100"`` for ``"NVIDIA H100 80GB HBM3"``)."""
    if short:
        slug = re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")
        return slug.split("-")[0] if slug else "gpu"
    return name.replace("NVIDIA ", "").replace(" ", "-").lower()


def results_path(out_dir: str | Path, kind: str, name: str, world: int, *suffixes: str) -> Path:
    """``OUT/<kind>-<device>-x<world>-<date>[-<suffix>...].json`` (empty suffixes left out); creates OUT."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tail = "".join(f"-{s}" for s in suffixes if s)
    return out / f"{kind}-{device_slug(name)}-x{world}-{today()}{tail}.json"


def version(package: str) -> str | int | None:
    """The version of ``package`` (``torch``, ``transformers``, ``triton``; a distribution name such as
    ``nvidia-cudnn-frontend``) or of torch's ``cuda``, ``cudnn`` and ``nccl``; None when it is missing."""
    if "-" in package:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            return dist_version(package)
        except PackageNotFoundError:
            return None
    if package == "cuda":
        return torch.version.cuda
    if package == "cudnn":
        return torch.backends.cudnn.version()
    if package == "nccl":
        return ".".join(map(str, torch.cuda.nccl.version()))
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def env_vars(*keys: str) -> dict[str, str | None]:
    """The named environment variables (None where unset)."""
    return {key: os.environ.get(key) for key in keys}


def run_meta(name: str, world: int, *packages: str, env: tuple[str, ...] = ()) -> dict:
    """The metadata every results file starts with: device, world, date, the versions of torch and of
    ``packages`` (those installed), and (``env``) the named environment variables."""
    meta: dict = {"device": name, "world": world, "date": today(), "torch": torch.__version__}
    for package in packages:
        found = version(package)
        if found is not None:
            meta[package] = found
    if env:
        meta["env"] = env_vars(*env)
    return meta


def failure(err: BaseException | None = None, limit: int = 4) -> dict:
    """A row's ``error`` for the exception being handled: ``"out of memory"`` (with the allocator's
    message in ``oom_message``) or the last ``limit`` frames of the traceback."""
    if err is not None and (isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err)):
        return {"error": "out of memory", "oom_message": str(err).splitlines()[0][:400]}
    return {"error": traceback.format_exc(limit=limit)}


def find(rows: list[dict], field: str = "ms", **match) -> object | None:
    """``field`` of the first row that has it and matches every ``key=value`` of ``match``."""
    for row in rows:
        if field in row and all(row.get(key) == value for key, value in match.items()):
            return row[field]
    return None


class ResultsFile:
    """A run's results: ``{**meta, **sections, "rows": [...], "summary": summarize(rows)}``, rewritten
    by rank 0 after every row, so that a run cut off by a time limit keeps what it measured."""

    def __init__(self, path: Path, meta: dict, summarize: Callable[[list[dict]], dict], *, rank: int = 0,
                 rows: list[dict] | None = None, echo: Callable[[dict], dict] = lambda row: row) -> None:
        self.path, self.meta, self.summarize, self.rank, self.echo = path, meta, summarize, rank, echo
        self.rows: list[dict] = [] if rows is None else rows
        self.sections: dict = {}

    def document(self) -> dict:
        return {**self.meta, **self.sections, "rows": self.rows, "summary": self.summarize(self.rows)}

    def write(self) -> None:
        if self.rank == 0:
            self.path.write_text(json.dumps(self.document(), indent=1))

    def record(self, row: dict) -> None:
        """Append ``row``, print it (rank 0) and rewrite the file."""
        self.rows.append(row)
        if self.rank == 0:
            print(json.dumps(self.echo(row)), flush=True)
        self.write()
