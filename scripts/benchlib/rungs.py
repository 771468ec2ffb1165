"""One ``bench_train.py --rung`` launch under a time limit, read back as a results row: the rung's own row,
a failed rank's row, or how the launch ended (its time limit, a rank killed by the host's out-of-memory
killer, the first exception line of its log). Shared by ``maxctx_ladder.py`` and ``bench_peers.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["MULTICAST_OFF", "ROOT", "alive", "bench_train_command", "detach", "nvidia_smi", "run_launch",
           "wait_idle_gpus", "why_the_launch_failed"]

ROOT = Path(__file__).resolve().parents[2]
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b: ")


def nvidia_smi(query: str) -> list[list[str]]:
    """``nvidia-smi --query-<query>`` as rows of fields (empty without nvidia-smi)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def wait_idle_gpus(device: str, seconds: int = 60) -> None:
    """A launch ended by its time limit may leave processes holding the GPUs for a few seconds."""
    for _ in range(seconds if device == "cuda" else 0):
        if not any(row and row[0] for row in nvidia_smi("compute-apps=pid")):
            return
        time.sleep(1)


def why_the_launch_failed(lines: list[str], code: int) -> dict:
    """The error of a launch whose ranks wrote no row, from its log: an out-of-memory message (NCCL's can
    end a process from its watchdog thread), a rank killed by SIGKILL (what the kernel's out-of-memory
    killer sends when the host's memory runs out: a host out-of-memory), else the first exception line."""
    oom = next((line for line in lines if "out of memory" in line.lower()), None)
    if oom:
        return {"error": "out of memory", "oom_message": oom[:400]}
    if any("Signal 9 (SIGKILL)" in line or "exitcode: -9" in line for line in lines):
        return {"error": "out of memory", "failed_phase": "host",
                "oom_message": "a rank was killed by SIGKILL: the host's out-of-memory killer, most likely "
                               "(nothing else on these machines sends it)"}
    raised = next((line.strip() for line in lines if _EXCEPTION_LINE.match(line.strip())), None)
    return {"error": f"exit status {code}: " + (raised[:400] if raised else
                                               " | ".join(line[:200] for line in lines[-15:]))}


def bench_train_command(world: int, model: str, n: int, variant: str, steps: int, row_out: Path,
                        *extra: str) -> list[str]:
    """``torchrun ... bench_train.py --rung``: one variant at one length, ``steps`` steps (the first a
    warm-up when there are several), the AdamW state allocated before the first."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    return [*launcher, str(ROOT / "scripts" / "bench_train.py"), "--rung", "--model", model, "--seqs", str(n),
            "--variants", variant, "--steps", str(steps), "--row-out", str(row_out), *extra]


def run_launch(command: list[str], row_out: Path, log: Path, limit: float, device: str) -> dict:
    """Run ``command`` (which writes ``{meta, row}`` to ``row_out``, or a failed rank's row to
    ``row_out.rank<r>``) under ``limit`` seconds, its output in ``log``. Returns ``{"row", "meta",
    "wall_s"}``; the row says how the launch ended when no rank wrote one."""
    for stale in row_out.parent.glob(f"{row_out.name}*"):
        stale.unlink()
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in MULTICAST_OFF.items()},
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    tic = time.perf_counter()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
    wall = time.perf_counter() - tic
    wait_idle_gpus(device)
    if code == 0 and row_out.exists():
        found = json.loads(row_out.read_text())
        return {"row": found["row"], "meta": found["meta"], "wall_s": wall}
    row: dict = {}
    failed = sorted(row_out.parent.glob(f"{row_out.name}.rank*"))
    if failed:
        row = json.loads(failed[0].read_text())
        row["failed_ranks"] = [int(p.name.rsplit("rank", 1)[1]) for p in failed]
    elif code is None:
        row["error"] = f"time limit ({limit:.0f} s)"
    else:
        row.update(why_the_launch_failed(log.read_text(errors="replace").splitlines(), code))
    return {"row": row, "meta": None, "wall_s": wall}


def detach(command: list[str], log: Path) -> int:
    """Start ``command`` detached (it outlives the caller), its output in ``log``; its pid."""
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    return proc.pid


def alive(pid: int | None) -> bool:
    """Whether ``pid`` runs (a finished child nobody reaped, a zombie, does not)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True
