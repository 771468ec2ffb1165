"""The fine-tune off its paved path: each case gives the right result or one line naming the fix.

In process: ``~`` in ``output_dir``, YAML merge keys, ``logging.metrics_file`` in a subdirectory, a data
file that is not UTF-8 or not valid JSON, an output directory another run holds (a lock), ``--check``
running what a run checks before its first step (a missing text column, a ``model.path`` without a
tokenizer, a resume whose schedule or data differ), ``model.config.vocab_size`` with ``model.path``
(the tokenizer-fit advice, followed). Single-process runs: a data file changed between a run and its
resume; stale ``WORLD_SIZE``/``RANK`` in the environment.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from lightseq_hf.training.cli import main
from lightseq_hf.training.config import ConfigError, config_from_dict, load_config
from lightseq_hf.training.output import LOCK_FILE, MetricsWriter, prepare_output_dir
from lightseq_hf.training.saving import write_completion_record

ROOT = Path(__file__).resolve().parents[1]
TEXT = yaml.safe_load((ROOT / "configs" / "tiny-text.yaml").read_text())
SMALL = ["training.device=cpu", "logging.progress_bar=false", "logging.plot=false", "context_length=64",
         "model.config.max_position_embeddings=64", "sp_size=1"]


def _text_config(tmp_path: Path, *overrides: str):
    data = tmp_path / "docs.txt"
    if not data.exists():
        data.write_text("".join(f"document {i} " * 20 + "\n" for i in range(40)))
    return config_from_dict(TEXT, [f"data.paths=[{data}]", f"output_dir={tmp_path / 'run'}", *SMALL,
                                   *overrides], base_dir=ROOT / "configs")


def _one_line_error(capsys, code: int, needle: str) -> None:
    err = capsys.readouterr().err
    assert needle in err, err
    assert err.count("\n") == 1, err


def test_home_in_output_dir_and_yaml_merge_keys(tmp_path: Path) -> None:
    cfg = _text_config(tmp_path, "output_dir=~/lightseq-runs/x")
    assert cfg.output_dir == os.path.expanduser("~/lightseq-runs/x") and "~" not in cfg.output_dir
    shared = {"lr": 1.0e-3, "max_steps": 5}
    text = yaml.safe_dump({**TEXT, "training": {}}).replace(
        "training: {}", "x-common: &common\n  lr: 1.0e-3\n  max_steps: 5\ntraining:\n  <<: *common\n"
                        "  max_steps: 7")
    path = ROOT / "configs" / f"merge-{os.getpid()}.yaml"  # relative data paths resolve from configs/
    path.write_text(text)
    try:
        cfg = load_config(path)
    finally:
        path.unlink()
    assert (cfg.training.lr, cfg.training.max_steps) == (shared["lr"], 7)  # the mapping's own key wins


def test_metrics_file_in_a_subdirectory(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "logs" / "deep" / "m.jsonl", None)
    writer.write({"step": 1, "loss": 1.0})
    assert (tmp_path / "logs" / "deep" / "m.jsonl").read_text().startswith('{"step": 1')


@pytest.mark.parametrize(("content", "needle"), [
    (b"caf\xe9 ol\xe9\n", "not UTF-8 text ('utf-8' codec can't decode byte 0xe9 in position 3"),
    (b'{"text": "fine"}\n{"text": broken\n', "could not be read (ArrowInvalid: JSON parse error"),
])
def test_unreadable_data_file_is_one_config_error(tmp_path: Path, content: bytes, needle: str) -> None:
    from lightseq_hf.training.data import load_raw_dataset

    path = tmp_path / ("data.jsonl" if content.startswith(b"{") else "data.txt")
    path.write_bytes(content)
    cfg = _text_config(tmp_path, f"data.paths=[{path}]", "data.format=auto")
    with pytest.raises(ConfigError) as e:
        load_raw_dataset(cfg.data)
    assert needle in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)


def test_an_output_dir_in_use_is_refused(tmp_path: Path) -> None:
    cfg = _text_config(tmp_path)
    out = Path(cfg.output_dir)
    out.mkdir()
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT)  # another process's run holds the lock
    os.write(fd, b"process 4242 on elsewhere")
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        for dry_run in (True, False):
            with pytest.raises(ConfigError, match=r"in use by a run that has not ended \(process 4242"):
                prepare_output_dir(cfg, dry_run=dry_run)
    finally:
        os.close(fd)  # the run ended (or crashed): the system released its lock
    assert prepare_output_dir(cfg) is None
    probe = subprocess.run([sys.executable, "-c", "import fcntl, os; fcntl.flock(os.open("
                            f"{str(out / LOCK_FILE)!r}, os.O_RDWR), fcntl.LOCK_EX | fcntl.LOCK_NB)"],
                           capture_output=True)
    assert probe.returncode != 0  # held by this process for the rest of its run


def test_check_runs_what_the_run_checks_before_its_first_step(tmp_path: Path, capsys) -> None:
    base = [str(ROOT / "configs" / "tiny-text.yaml"), "--check", "--world-size", "1", *SMALL]
    data = tmp_path / "docs.txt"
    data.write_text("some text\n" * 50)
    base += [f"data.paths=[{data}]"]
    assert main([*base, f"output_dir={tmp_path / 'a'}", "data.text_field=body"]) == 2
    _one_line_error(capsys, 2, "config error: data.text_field: column 'body' not in the data")
    model_dir = tmp_path / "model"  # a model directory without tokenizer files
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).save_pretrained(model_dir)
    capsys.readouterr()  # the save's progress bar
    assert main([*base, f"output_dir={tmp_path / 'b'}", f"model.path={model_dir}", "tokenizer=null",
                 "model.config={}"]) == 2
    _one_line_error(capsys, 2, "text data needs a tokenizer, and model.path holds none")
    out = tmp_path / "c"  # a checkpoint of 10 scheduled steps, then a resume with 20
    (out / "checkpoint-4" / "state").mkdir(parents=True)
    (out / "checkpoint-4" / "state" / "x.bin").write_bytes(b"state")
    write_completion_record(out / "checkpoint-4", 4, {"schedule_steps": 10})
    resume = [*base, f"output_dir={out}", "saving.resume_from=latest"]
    assert main([*resume, "training.max_steps=20"]) == 2
    _one_line_error(capsys, 2, "was trained with a learning-rate schedule of 10 steps, this run has 20")
    assert main([*resume, "training.max_steps=10"]) == 0
    checked = capsys.readouterr().out
    assert "resume data matches, continues at the start of epoch 0, schedule matches" in checked, checked
    write_completion_record(out / "checkpoint-4", 4, {"schedule_steps": 10, "data_fingerprint": "0123"})
    assert main([*resume, "training.max_steps=10"]) == 2
    _one_line_error(capsys, 2, "the training data changed since")


def test_vocab_size_advice_works_with_model_path(tmp_path: Path) -> None:
    from lightseq_hf.training.build import build_model, check_tokenizer_fits
    from lightseq_hf.training.data import ByteTokenizer

    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    saved = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=200, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    saved.save_pretrained(model_dir)
    with pytest.raises(ConfigError, match="set model.config.vocab_size=257") as e:
        _text_config(tmp_path, f"model.path={model_dir}", "model.config={}")
    assert "\n" not in str(e.value)
    cfg = _text_config(tmp_path, f"model.path={model_dir}", "model.config={vocab_size: 257}")
    model = build_model(cfg)  # the advice, followed: the checkpoint's rows kept, 57 rows added
    check_tokenizer_fits(cfg, ByteTokenizer(), model.config.vocab_size)
    assert model.get_input_embeddings().num_embeddings == 257
    assert torch.equal(model.get_input_embeddings().weight[:200], saved.get_input_embeddings().weight)


def _finetune(args: list[str], env: dict | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "lightseq_hf.training.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("lightseq-finetune:")]


@pytest.mark.slow
def test_resume_with_changed_data_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "docs.txt"
    data.write_text("".join(f"document {i} " * 20 + "\n" for i in range(40)))
    run = [str(ROOT / "configs" / "tiny-text.yaml"), *SMALL, f"data.paths=[{data}]",
           f"output_dir={tmp_path}/r", "saving.every=1", "training.max_steps=3"]
    first = _finetune([*run, "training.max_steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    data.write_text(data.read_text().replace("document 7", "document 8"))
    again = _finetune([*run, "saving.resume_from=latest", "saving.on_schedule_change=rebuild"])
    assert again.returncode == 2, again.stderr[-3000:]
    assert len(_errors(again)) == 1 and "the training data changed since" in _errors(again)[0]


@pytest.mark.slow
def test_stale_world_size_in_the_environment_is_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(WORLD_SIZE="2", RANK="0")
    proc = _finetune([str(ROOT / "configs" / "tiny.yaml"), f"output_dir={tmp_path}/r",
                      "training.timeout_s=5"], env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = _errors(proc)
    assert "could not start the process group that the environment describes (WORLD_SIZE=2, RANK=0" in line
    assert "unset WORLD_SIZE, RANK" in line and "Traceback" not in proc.stderr
