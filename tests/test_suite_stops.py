"""Ctrl-C of the test suite leaves no process behind (tests/conftest.py, tests/distributed.py).

A pytest run of one test that starts what the suite's tests start, a group of spawned workers
(``run_distributed``) and a launcher whose worker outlives it, is interrupted with SIGINT to the pytest
process alone (what CI's runner sends); it must exit within seconds, and none of the processes it started
(all in the setsid group it leads) may remain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

INTERRUPTED = '''
import subprocess
import sys
import time

from distributed import run_distributed

LAUNCHER = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)")


def _computing(rank, world):
    while True:
        time.sleep(0.1)


def test_interrupted():
    subprocess.Popen([sys.executable, "-c", LAUNCHER])
    run_distributed(_computing, 2)
'''


def _led_by(leader: int) -> list[int]:
    """Live (not zombie) processes led by ``leader`` (its setsid group: every process it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if entry.name.isdigit() and int(fields[3]) == leader and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def test_ctrl_c_of_the_suite_leaves_no_process(tmp_path: Path) -> None:
    (tmp_path / "test_interrupted.py").write_text(INTERRUPTED)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
               str(tmp_path / "test_interrupted.py")]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_led_by(proc.pid)) < 5:  # pytest, 2 spawned workers, the launcher and its worker
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.5)
        time.sleep(1.0)
        tic = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        waited = time.monotonic() - tic
        time.sleep(0.5)
        assert not _led_by(proc.pid), (_led_by(proc.pid), out[-3000:])
        assert "KeyboardInterrupt" in out and waited < 30, (waited, out[-3000:])
    finally:
        for pid in _led_by(proc.pid):
            os.kill(pid, signal.SIGKILL)
