"""A step that runs out of memory ends every rank with one line naming the planner's advice; the launcher
gives its workers the CUDA allocator's expandable segments unless the user chose a setting.

Launched runs (2 CPU processes, gloo) raise ``torch.OutOfMemoryError`` from the first decoder layer of one
rank (``lightseq_hf._testing.faults``, points ``forward`` and ``backward``), through ``lightseq-finetune
--nproc`` and through ``accelerate launch``. In process: what counts as out of memory, the advice against
the planner's own numbers, and the notice board between two store clients.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from lightseq_hf._testing.faults import ENV as FAULTS_ENV
from lightseq_hf.planner import GIB, longest_context
from lightseq_hf.training import cli
from lightseq_hf.training.config import config_from_dict
from lightseq_hf.training.guards import PeerFailure
from lightseq_hf.training.planning import memory_advice, plan_inputs
from lightseq_hf.training.processes import launch
from lightseq_hf.training.processes.board import FailureBoard, is_out_of_memory, out_of_memory_line
from lightseq_hf.training.processes.watchdog import PeerWatch
from lightseq_hf.training.shape import run_shape

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["training.device=cpu", "logging.progress_bar=false", "data.synthetic.eval_samples=2",
         "context_length=256", "model.config.max_position_embeddings=256", "logging.plot=false",
         "training.max_steps=3"]
ALLOCATOR_LINE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the CUDA allocator grows"


def _config(name: str, *overrides: str):
    return config_from_dict(yaml.safe_load((ROOT / "configs" / name).read_text()), list(overrides),
                            base_dir=ROOT / "configs")


# ----------------------------------------------------------------------------- launched runs


def _launch(command: list[str], fault: str, timeout: int = 240) -> tuple[int, str, float]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env[FAULTS_ENV] = fault
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(name, None)
    tic = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - tic


def _check_one_line_per_rank(out: str, failed: int, phase: str, step: int, world: int = 2) -> None:
    """One line on each rank, no worker traceback (accelerate's launcher adds its own, one, as it does
    for any failed worker)."""
    assert out.count("Traceback") == out.count("raise ChildFailedError("), out[-4000:]
    reason = f"rank {failed} ran out of memory in '{phase}' at step {step} (tried to allocate 2.00 GiB)"
    lines = [line for line in out.splitlines() if "ran out of memory" in line]
    assert sum(line.startswith(f"lightseq-finetune: stopped: {reason}") for line in lines) == 1, lines
    for rank in range(world):  # every other rank says it stopped because of that one, with the advice
        if rank != failed:
            assert sum(line.startswith(f"lightseq-finetune: stopped on rank {rank}: {reason}")
                       for line in lines) == 1, lines
    assert len(lines) == world, lines
    assert all("the planner, for" in line and "context_length=" in line for line in lines), lines
    assert len({line.split(reason, 1)[1] for line in lines}) == 1  # the same advice everywhere


@pytest.mark.slow
def test_out_of_memory_in_forward_through_the_launcher(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lightseq_hf._testing.faults", "--nproc", "2", "configs/tiny.yaml",
               *SMALL, f"output_dir={tmp_path / 'r'}"]
    rc, out, wall = _launch(command, "forward:1:2:oom")
    assert rc == 1, out[-4000:]
    assert "fault injection: oom at forward, rank 1, step 2" in out
    _check_one_line_per_rank(out, failed=1, phase="forward/backward", step=2)
    assert out.count(ALLOCATOR_LINE) == 0, out[-4000:]  # a CPU run does not speak of the CUDA allocator
    assert "lightseq-finetune: rank" not in out  # the launcher had nothing to add: both reported
    assert wall < 90, wall  # start-up (~15-30 s on 2 shared cores), not training.timeout_s


@pytest.mark.slow
def test_out_of_memory_in_backward_under_accelerate_launch(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / "cpu-2proc.yaml"), "-m", "lightseq_hf._testing.faults",
               "configs/tiny.yaml", *SMALL, f"output_dir={tmp_path / 'r'}"]
    rc, out, wall = _launch(command, "backward:0:1:oom")
    assert rc != 0, out[-4000:]
    assert "fault injection: oom at backward, rank 0, step 1" in out
    _check_one_line_per_rank(out, failed=0, phase="forward/backward", step=1)
    assert out.count(ALLOCATOR_LINE) == 0, out[-4000:]  # a CPU run does not speak of the CUDA allocator
    assert wall < 90, wall


# ----------------------------------------------------------------------------- the allocator default


def test_workers_get_expandable_segments_before_cuda_unless_the_user_chose(monkeypatch, capsys) -> None:
    """``main`` sets the variable before the worker's first device allocation: the Accelerator (which
    picks and initializes the device) sees it; a user's setting is kept and named."""
    from lightseq_hf.training import loop

    seen = []

    def stop_at_start(self):
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        raise cli.ConfigError("stopped by the test")

    monkeypatch.setattr(loop.Trainer, "setup", stop_at_start)  # its first act starts the Accelerator
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # restored (unset) after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    args = [str(ROOT / "configs" / "tiny.yaml"), "training.device=cpu", "output_dir=/nonexistent/x"]
    assert cli.main(args) == 2
    assert seen == ["expandable_segments:True"]
    assert capsys.readouterr().out.count(ALLOCATOR_LINE) == 0  # set, but a CPU run does not say so
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: rank 0 says it once
    gpu_args = [*args[:1], "training.device=auto", *args[2:]]
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert cli.main(gpu_args) == 2
    assert seen[-1] == "expandable_segments:True" and capsys.readouterr().out.count(ALLOCATOR_LINE) == 1

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert cli.main(gpu_args) == 2
    assert seen[-1] == "max_split_size_mb:512"
    assert "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 (set by the user)" in capsys.readouterr().out

    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}  # torch's newer name counts as a choice
    line = launch.use_expandable_segments(env)
    assert "PYTORCH_ALLOC_CONF=expandable_segments:False (set by the user)" in line
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env


# ----------------------------------------------------------------------------- in process


def test_what_counts_as_out_of_memory() -> None:
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    nccl = dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error, NCCL "
                                 "version 2.27.3\nLast error:\nCuda failure 'out of memory'")
    assert is_out_of_memory(nccl)
    wrapped = PeerFailure("rank 0: 'forward/backward' at step 3 could not complete")
    wrapped.__cause__ = nccl  # what Progress.phase makes of a backend error
    assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("Connection closed by peer [127.0.0.1]:29500"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not an error a device raises


def test_the_line_names_rank_phase_request_and_advice() -> None:
    err = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total ...")
    line = out_of_memory_line(3, "optimizer step", 7, err, torch.device("cpu"), "ADVICE")
    assert line == ("rank 3 ran out of memory in 'optimizer step' at step 7 (tried to allocate 1.50 GiB); "
                    "ADVICE")
    assert "\n" not in line


def test_advice_is_the_planners_cheapest_option_that_fits() -> None:
    """Llama-3-8B at 256K on 4 x 80 GB (sp 4, FSDP), default options: the advice names the first option
    (cheapest in step time) whose longest context, by ``longest_context``, reaches 256K."""
    cfg = _config("llama3-8b-128k.yaml", "sp_size=4", "context_length=262144",
                  "model.config.max_position_embeddings=262144")
    gpu, host = 75 * GIB, 115 * GIB
    advice = memory_advice(cfg, run_shape(cfg, 4), "fsdp", gpu, host)
    shape, opts = plan_inputs(cfg, 4, "fsdp")
    from dataclasses import replace

    as_is = longest_context(shape, opts, gpu, host)
    auto = longest_context(shape, replace(opts, offload_checkpoints="auto"), gpu, host)
    assert as_is < 262144 <= auto, (as_is, auto)
    assert advice.startswith("the planner, for 75 GiB of device and 115 GiB of host memory per rank, ")
    assert f"fits up to {as_is} tokens as configured" in advice
    assert f"turn on training.offload_checkpoints=auto (fits up to {auto} tokens)" in advice
    assert f"or set context_length={as_is}" in advice

    # nothing fits the device: every option left, together, and how far they reach
    tight = memory_advice(cfg, run_shape(cfg, 4), "fsdp", 40 * GIB, 115 * GIB)
    assert "training.offload_checkpoints=auto and training.tiled_mlp=8192 and training.cpu_offload=true " \
           "(together up to" in tight, tight

    # the plan said it fits: the line says so and proposes a margin
    eight_b = _config("llama3-8b-128k.yaml", "sp_size=4")
    fits = memory_advice(eight_b, run_shape(eight_b, 4), "fsdp", gpu, host)
    assert "expected 131072 tokens to fit" in fits and "context_length=114688" in fits, fits

    # a planner that cannot read the config still gives a line
    broken = _config("tiny.yaml")
    broken.model.config = {"model_type": "llama", "hidden_size": 0}
    assert "--plan shows what fits" in memory_advice(broken, run_shape(broken, 2), "fsdp", gpu, host)


def test_notice_board_tells_a_peer_and_waits_until_it_read() -> None:
    """Two ranks' boards on one store: rank 1 publishes; rank 0's watch reports the line (marking it read)
    and stops; rank 1's wait returns once read. A rank that failed itself only marks others' notices."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    board0, board1 = FailureBoard(store, 0, 2), FailureBoard(store, 1, 2)
    reports = []
    watch = PeerWatch(board0, interval_s=0.02, on_failure=lambda line, read: (reports.append(line), read()))
    watch.start()
    assert board0.notices() == {} and not board1.wait_read(timeout_s=0.1)
    board1.publish("rank 1 ran out of memory in 'forward/backward' at step 2; advice")
    assert board1.wait_read(timeout_s=5)
    watch.join(timeout=5)
    assert not watch.is_alive()
    assert reports == ["stopped on rank 0: rank 1 ran out of memory in 'forward/backward' at step 2; advice"]

    board0.publish("rank 0 ran out of memory too")  # both failed: each reports its own line only
    both = PeerWatch(board1, interval_s=0.02, on_failure=lambda line, read: pytest.fail(line))
    both.start()
    assert board0.wait_read(timeout_s=5)
    both.stop()
    assert not both.is_alive()
