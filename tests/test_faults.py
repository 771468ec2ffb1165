"""Fault injection: nothing lost, nothing silent, no hangs, clean errors.

Runs through ``accelerate launch`` on 2 CPU processes kill a rank in the middle of a checkpoint save
and resume (falls back to the last complete checkpoint, same losses), freeze a rank (every rank ends
within the timeout, naming rank and operation), inject a NaN loss (stops, or skips as configured).
The rest runs in-process or in one spawned 2-process group: checkpoint records and corruption,
resume policy, schedule changes, per-call agreement checks of dist_flash_attn, the same-batch
fingerprint, non-contiguous inputs in the distributed backward, NaN rows, head_dim 0, the CLI.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from distributed import rel_err, run_distributed

from lightseq_hf._testing.faults import ENV as FAULTS_ENV
from lightseq_hf.training.config import ConfigError, config_from_dict
from lightseq_hf.training.saving import (
    COMPLETION_RECORD,
    CheckpointError,
    find_latest_checkpoint,
    publish,
    verify_checkpoint,
    write_completion_record,
)

ROOT = Path(__file__).resolve().parents[1]
# lightseq-finetune --nproc 2 with the private fault-injection entry point (lightseq_hf/_testing/faults.py)
LAUNCH = [sys.executable, "-m", "lightseq_hf._testing.faults", "--nproc", "2", "configs/tiny.yaml"]
# a 256-token context: each step takes milliseconds, a launch ~15 s (start-up)
SMALL = ["training.device=cpu", "logging.progress_bar=false", "data.synthetic.eval_samples=2",
         "context_length=256", "model.config.max_position_embeddings=256", "logging.plot=false"]


def _launch(args: list[str], fault: str | None = None, timeout: int = 180) -> tuple[int, str, float]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop(FAULTS_ENV, None)
    if fault:
        env[FAULTS_ENV] = fault
    tic = time.perf_counter()
    proc = subprocess.run(LAUNCH + SMALL + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - tic


def _records(path: Path, kind: str = "train") -> dict[int, dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in recs if r.get("kind") == kind}


def _config(out_dir: Path, *overrides: str):
    return config_from_dict(yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text()),
                            [f"output_dir={out_dir}", *overrides], base_dir=ROOT / "configs")


# ----------------------------------------------------------------------------- launched runs


@pytest.mark.slow
def test_kill_during_save_then_resume_falls_back_to_last_complete(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["training.max_steps=4", "saving.every=2", f"output_dir={run}"]
    rc, out, _ = _launch(args, fault="save:1:4:kill")  # rank 1 dies after rank 0 wrote the weights
    assert rc != 0, out[-3000:]
    assert "fault injection: kill at save, rank 1, step 4" in out
    assert "lightseq-finetune: rank 1 was killed by SIGKILL" in out  # the launcher's one line for it
    assert not (run / "checkpoint-4").exists() and (run / ".checkpoint-4.tmp" / "model.safetensors").is_file()
    verify_checkpoint(run / "checkpoint-2")  # the earlier save is complete and intact
    first = _records(run / "metrics.jsonl")
    assert sorted(first) == [1, 2, 3, 4]  # every completed step was logged before the crash

    # a fresh start into the crashed run's directory is refused before anything is touched
    proc = subprocess.run([sys.executable, "scripts/finetune.py", "configs/tiny.yaml", *SMALL, *args,
                           "--check", "--world-size", "2"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    rc, out, _ = _launch(args + ["saving.resume_from=latest"])
    assert rc == 0, out[-3000:]
    assert f"resumed from {run / 'checkpoint-2'}: step 2" in out and "checksums verified" in out
    again = _records(run / "metrics.jsonl")
    assert sorted(again) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):  # kept records, and re-run steps with bit-identical losses
        assert again[step]["loss"] == first[step]["loss"], (step, again[step], first[step])
    backup = run / "metrics.jsonl.before-resume-2"
    assert sorted(_records(backup)) == [1, 2, 3, 4]  # the replaced records are kept, not truncated
    verify_checkpoint(run / "checkpoint-4")
    assert not list(run.glob(".checkpoint-*.tmp"))

    # corrupt the newest checkpoint: `latest` skips it with a reason; an explicit resume names the file
    opt = run / "checkpoint-4" / "state" / "optimizer.bin"
    with open(opt, "r+b") as f:
        f.seek(200)
        f.write(b"garbage!" * 512)
    latest, skipped = find_latest_checkpoint(run)
    assert latest == run / "checkpoint-2" and "state/optimizer.bin" in skipped[0] and "sha256" in skipped[0]
    from lightseq_hf.training.output import prepare_output_dir  # what rank 0 runs before loading

    with pytest.raises(CheckpointError, match="checkpoint-4 is damaged: state/optimizer.bin does not match"):
        prepare_output_dir(_config(tmp_path / "other", f"saving.resume_from={run / 'checkpoint-4'}",
                                   "saving.resume_other_run=true"))


@pytest.mark.slow
def test_frozen_rank_ends_every_rank_within_the_timeout(tmp_path: Path) -> None:
    rc, out, wall = _launch(["training.max_steps=4", "training.timeout_s=4", f"output_dir={tmp_path / 'r'}"],
                            fault="step:1:2:hang")
    assert rc != 0, out[-3000:]
    assert "rank 0: 'forward/backward' at step 2 could not complete" in out, out[-3000:]
    assert "training.timeout_s=4 s" in out and "rank 1 last in" in out
    assert wall < 90, wall  # start-up (~15 s on 2 cores) + the 4 s timeout, not the 30 min default


@pytest.mark.slow
def test_nan_loss_stops_or_skips(tmp_path: Path) -> None:
    run = tmp_path / "nan"
    rc, out, _ = _launch(["training.max_steps=4", "saving.every=1", f"output_dir={run}"],
                         fault="loss:1:2:nan")
    assert rc == 1, out[-3000:]
    assert "step 2: non-finite loss (nan)" in out and out.count("non-finite loss") == 1
    assert sorted(_records(run / "metrics.jsonl")) == [1]
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-1"]  # nothing NaN saved

    run = tmp_path / "skip"
    rc, out, _ = _launch(["training.max_steps=3", "training.on_nonfinite=skip", f"output_dir={run}"],
                         fault="loss:1:2:nan")
    assert rc == 0, out[-3000:]
    recs = _records(run / "metrics.jsonl")
    assert recs[2].get("skipped") is True and not recs[3].get("skipped")
    assert recs[2]["loss"] is None and recs[2]["nonfinite"]["loss"] == "nan"  # strict JSON, value kept
    strict = {"parse_constant": lambda c: pytest.fail(f"non-strict JSON constant {c}")}
    assert json.loads((run / "summary.json").read_text(), **strict)["skipped_steps"] == 1
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line, **strict)
    from safetensors.torch import load_file

    weights = load_file(run / "checkpoint-3" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_run_tiny_config_error_is_one_line_exit_2() -> None:
    tic = time.perf_counter()
    proc = subprocess.run(["bash", "scripts/run_tiny.sh", "training.lr=.nan"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert lines == ["lightseq-finetune: config error: training.lr: input should be a finite number; got nan"]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert time.perf_counter() - tic < 120  # no reinstall: setup_env.sh's stamp matches


# ----------------------------------------------------------------------------- in process


def _fake_checkpoint(root: Path, step: int, state: bool = True) -> Path:
    tmp = root / f".checkpoint-{step}.tmp"
    (tmp / "state").mkdir(parents=True) if state else tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(os.urandom(4096))
    if state:
        (tmp / "state" / "optimizer.bin").write_bytes(os.urandom(8192))
    write_completion_record(tmp, step)
    final = root / f"checkpoint-{step}"
    publish(tmp, final)
    return final


def test_checkpoint_records_catch_partial_truncated_and_corrupt(tmp_path: Path) -> None:
    c2, c4, c6 = (_fake_checkpoint(tmp_path, s) for s in (2, 4, 6))
    assert verify_checkpoint(c6)["step"] == 6
    assert find_latest_checkpoint(tmp_path) == (c6, [])
    (c6 / COMPLETION_RECORD).unlink()  # an old-style or interrupted directory
    with open(c4 / "state" / "optimizer.bin", "r+b") as f:
        f.truncate(100)
    latest, skipped = find_latest_checkpoint(tmp_path)
    assert latest == c2 and len(skipped) == 2
    assert "checkpoint-6 is incomplete" in skipped[0] and "state/optimizer.bin has 100 bytes" in skipped[1]
    data = bytearray((c2 / "model.safetensors").read_bytes())
    data[10] ^= 0xFF  # same size, different bytes
    (c2 / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors does not match its recorded sha256"):
        verify_checkpoint(c2)
    verify_checkpoint(c2, checksums=False)  # sizes only
    assert find_latest_checkpoint(tmp_path)[0] is None
    aside = publish(_fake_checkpoint(tmp_path / "x", 9).rename(tmp_path / ".t"), c2)  # re-save of step 2
    assert aside is not None and aside.name.startswith("checkpoint-2.replaced-")
    assert (aside / "state").is_dir()
    verify_checkpoint(c2)


def test_resume_policy_never_destroys(tmp_path: Path) -> None:
    from lightseq_hf.training.output import MetricsWriter, prepare_output_dir

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match="no complete checkpoint with training state"):
        prepare_output_dir(_config(run, "saving.resume_from=latest"))
    assert prepare_output_dir(_config(run, "saving.resume_from=latest_or_fresh")) is None
    assert prepare_output_dir(_config(run)) is None  # empty directory: a fresh start
    lines = [json.dumps({"kind": "train", "step": s}) + "\n" for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(lines))
    weights_only = _fake_checkpoint(run, 2, state=False)  # saving.save_optimizer=false
    with pytest.raises(ConfigError, match="already holds a run"):
        prepare_output_dir(_config(run))
    with pytest.raises(ConfigError, match="no complete checkpoint with training state.*no state"):
        prepare_output_dir(_config(run, "saving.resume_from=latest"))
    with pytest.raises(CheckpointError, match="holds weights only"):
        prepare_output_dir(_config(run, f"saving.resume_from={weights_only}"))
    good = _fake_checkpoint(run, 3)
    assert prepare_output_dir(_config(run, "saving.resume_from=latest")) == good
    MetricsWriter(run / "metrics.jsonl", keep_until_step=2)
    assert sorted(_records(run / "metrics.jsonl")) == [1, 2]
    assert sorted(_records(run / "metrics.jsonl.before-resume-2")) == [1, 2, 3]
    assert prepare_output_dir(_config(run, "saving.if_output_exists=archive")) is None
    archived = next(run.glob("previous-*"))
    assert sorted(p.name for p in archived.iterdir()) == ["checkpoint-2", "checkpoint-3", "metrics.jsonl"]
    assert not list(run.glob("checkpoint-*"))
    (run / "metrics.jsonl").write_text(lines[0])  # a run that crashed before its first checkpoint
    assert prepare_output_dir(_config(run, "saving.resume_from=latest_or_fresh")) is None
    assert len(list(run.glob("previous-*"))) == 2 and not (run / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match="output_dir: cannot write"):
        prepare_output_dir(_config(run / "metrics.jsonl.before-resume-2" / "sub"))


def test_changed_schedule_length_is_an_error_or_logged_choice(tmp_path: Path, caplog) -> None:
    from lightseq_hf.training.build import lr_lambda
    from lightseq_hf.training.checkpoints import TrainState
    from lightseq_hf.training.checkpoints import reconcile_schedule as _reconcile_schedule

    caplog.set_level("INFO", logger="lightseq_hf")
    p = torch.nn.Parameter(torch.zeros(1))
    for choice, expect_total in (("error", None), ("keep", 240), ("rebuild", 480)):
        cfg = _config(tmp_path, "training.max_steps=480", f"saving.on_schedule_change={choice}")
        sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([p], lr=1.0), lr_lambda(cfg.training, 480))
        state = TrainState()
        state.step, state.schedule_steps = 200, 240
        if expect_total is None:
            with pytest.raises(ConfigError, match="schedule of 240 steps, this run has 480"):
                _reconcile_schedule(cfg.training, cfg.saving, state, 480, sched, tmp_path)
            continue
        _reconcile_schedule(cfg.training, cfg.saving, state, 480, sched, tmp_path)
        assert state.schedule_steps == expect_total
        assert sched.lr_lambdas[0](300) == lr_lambda(cfg.training, expect_total)(300)
        assert f"on_schedule_change={choice}" in caplog.text


def test_config_refuses_non_finite_and_cli_accepts_options_anywhere(tmp_path: Path, capsys,
                                                                    monkeypatch) -> None:
    from lightseq_hf.training.cli import main

    for bad, key in (("training.lr=.nan", "training.lr"), ("training.lr=.inf", "training.lr"),
                     ("training.weight_decay=.nan", "training.weight_decay"),
                     ("training.max_grad_norm=-.inf", "training.max_grad_norm"),
                     ("training.timeout_s=0", "training.timeout_s"), ("training.betas=[0.9, .nan]",
                                                                       "training.betas[1]")):
        with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
            _config(tmp_path, bad)
    cfg = str(ROOT / "configs" / "tiny.yaml")
    assert main(["--print-config", cfg, "training.max_steps=7"]) == 0
    assert "max_steps: 7" in capsys.readouterr().out
    assert main([cfg, "training.max_steps=7", "--print-config"]) == 0
    assert "max_steps: 7" in capsys.readouterr().out
    assert main([cfg, "--bogus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--bogus" in err
    monkeypatch.setenv("RANK", "1")  # under a launcher only rank 0 prints
    assert main([cfg, "training.lr=.nan"]) == 2
    assert capsys.readouterr().err == ""


def test_bytes_tokenizer_is_saved_and_found_again(tmp_path: Path) -> None:
    from lightseq_hf.training.data import ByteTokenizer, load_tokenizer

    ByteTokenizer().save_pretrained(tmp_path)  # what save_checkpoint calls for configs/tiny-text.yaml
    assert isinstance(load_tokenizer(None, str(tmp_path)), ByteTokenizer)


def test_faults_hook_and_failure_classification() -> None:
    import lightseq_hf.training as training
    from lightseq_hf._testing.faults import act, parse
    from lightseq_hf.training.guards import is_comm_failure

    faults = parse("loss:1:2:nan, save:0:4:kill")
    assert act(faults, "loss", 1, 2) and not act(faults, "loss", 0, 2) and not act(faults, "loss", 1, 3)
    for bad in ("loss:1", "loss:1:2:explode", "where:1:2:nan"):
        with pytest.raises(ValueError, match="point:rank:step:action"):
            parse(bad)
    assert not act(parse(""), "loss", 1, 2)
    # the library itself never reads the variable: no module of lightseq_hf/ outside _testing names it
    for path in Path(training.__file__).parents[1].rglob("*.py"):
        if "_testing" not in path.parts:
            assert FAULTS_ENV not in path.read_text() and "LIGHTSEQ_FAULT" not in path.read_text(), path
    assert is_comm_failure(RuntimeError("[gloo/transport/tcp/pair.cc:534] Timed out waiting 5000ms"))
    assert not is_comm_failure(ValueError("labels must be 2-D"))


def test_kernel_guards_head_dim_zero_nan_rows_triton_bf16(monkeypatch) -> None:
    from lightseq_hf.kernels import get_kernel
    from lightseq_hf.kernels.reference import ReferenceKernel
    from lightseq_hf.parallel.sharding import shift_labels

    with pytest.raises(ValueError, match="head_dim is 0"):
        import lightseq_hf

        z = torch.zeros(1, 4, 2, 0)
        lightseq_hf.dist_flash_attn(z, z, z)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="interpreter .* computes bfloat16 wrongly"):
        get_kernel("triton", torch.device("cpu"), torch.bfloat16, 64)
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    k, v = torch.randn(1, 6, 2, 8, dtype=torch.float64), torch.randn(1, 6, 2, 8, dtype=torch.float64)
    q[0, 3, 1] = float("nan")
    kern = ReferenceKernel(block_q=4, block_k=4)
    out, lse = kern.forward(q, k, v, causal=True, scale=0.3)
    assert torch.isnan(lse[0, 1, 3]) and torch.isnan(out[0, 3, 1]).all()
    assert torch.isfinite(lse[0, 0]).all() and torch.isfinite(lse[0, 1, :3]).all()
    run_out = torch.zeros(1, 6, 2, 8, dtype=torch.float64)  # merged into a running result (the ring)
    run_lse = torch.full((1, 2, 6), -math.inf, dtype=torch.float64)
    kern.forward(q, k[:, :3], v[:, :3], causal=False, scale=0.3, out=run_out, lse=run_lse)
    kern.forward(q, k[:, 3:], v[:, 3:], causal=False, scale=0.3, out=run_out, lse=run_lse)
    assert torch.isnan(run_lse[0, 1, 3]) and torch.isfinite(run_lse[0, 0]).all()
    with pytest.raises(ValueError, match="labels must be 2-D"):
        shift_labels(torch.zeros(5, dtype=torch.long))


# ----------------------------------------------------------------------------- 2 processes


def _expect_error(failures: list, rank: int, what: str, fn, needle: str) -> None:
    try:
        fn()
        failures.append(f"rank {rank}: {what} was accepted")
    except ValueError as e:
        if needle not in str(e):
            failures.append(f"rank {rank}: {what}: unhelpful message {e}")


def worker_agreement(rank: int, world: int) -> list[str]:
    import lightseq_hf
    from lightseq_hf.patches.batch import check_same_batch as _check_same_batch

    failures: list[str] = []
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 4, 16, generator=g)
    attn = lightseq_hf.dist_flash_attn
    _expect_error(failures, rank, "different softmax_scale", lambda: attn(q, q, q, softmax_scale=0.1 + rank),
                  "different softmax scales")
    _expect_error(failures, rank, "different schedule",
                  lambda: attn(q, q, q, schedule=("balanced", "ring")[rank]), "different schedules")
    _expect_error(failures, rank, "different backend",
                  lambda: attn(q, q, q, backend=("auto", "reference")[rank]), "different backends")
    qg = q.clone().requires_grad_(rank == 0)
    _expect_error(failures, rank, "different requires_grad", lambda: attn(qg, q, q), "requires_grad")

    # the same-batch fingerprint: one label differs at position 1008
    # (a position-weighted sum mod 1009 would miss it)
    ids = torch.randint(0, 100, (1, 1100), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    if rank == 1:
        labels[0, 1008] += 1
    _expect_error(failures, rank, "labels differing at position 1008",
                  lambda: _check_same_batch(None, 1, 1100, ids, labels, torch.device("cpu")),
                  "received different batches")
    _check_same_batch(None, 1, 1100, ids, ids.clone(), torch.device("cpu"))  # equal batches pass
    bad = ids[:, :1000] if rank == 1 else ids  # wrong label shape on one rank: every rank raises
    _expect_error(failures, rank, "labels of the wrong shape",
                  lambda: _check_same_batch(None, 1, 1100, ids, bad, torch.device("cpu")),
                  "wrong shape" if rank == 0 else "labels have shape (1, 1000)")

    # non-contiguous q/k/v (transposed views) in the distributed backward, against float64 full attention
    from test_dist_attn import naive_attention

    full = [torch.randn(1, 2, 16 * world, 8, dtype=torch.float64, generator=g) for _ in range(3)]
    dout = torch.randn(1, 16 * world, 2, 8, dtype=torch.float64, generator=g)
    leaves = [t.clone().requires_grad_() for t in full]
    ref_out, _ = naive_attention(*(t.transpose(1, 2) for t in leaves), True)
    ref_out.backward(dout)
    mine = [t[:, :, rank * 16:(rank + 1) * 16].clone().requires_grad_() for t in full]
    views = [t.transpose(1, 2) for t in mine]  # (b, s, h, d), not contiguous
    assert not views[1].is_contiguous()
    out = attn(*views, causal=True)
    out.backward(dout[:, rank * 16:(rank + 1) * 16])
    sl = slice(rank * 16, (rank + 1) * 16)
    for name, x, ref in (("out", out, ref_out[:, sl]), *((f"d{n}", m.grad, r.grad[:, :, sl])
                                                        for n, m, r in zip("qkv", mine, leaves))):
        err = rel_err(x, ref)
        if not err <= 1e-10:
            failures.append(f"rank {rank}: non-contiguous {name} rel err {err:.2e}")
    return failures


def test_per_call_agreement_fingerprint_and_non_contiguous_backward() -> None:
    failures = [f for rank_failures in run_distributed(worker_agreement, 2) for f in rank_failures]
    assert not failures, "\n".join(failures)
