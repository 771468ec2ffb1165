"""Ways a run could go wrong without saying so, each refused with one line naming the problem and the fix
(or given the right result): YAML and ``model.config`` mistakes, unbounded numbers, the tokenizer against
the model's vocabulary, non-integer token data, checkpoint records that vouch for nothing, another run's
checkpoint, and a finished run resumed (nothing may change)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightseq_hf.training.config import ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
TEXT = yaml.safe_load((ROOT / "configs" / "tiny-text.yaml").read_text())


def _refused(data: dict, overrides: list[str], message: str) -> str:
    with pytest.raises(ConfigError) as e:
        config_from_dict(data, overrides, base_dir=ROOT / "configs")
    text = str(e.value)
    assert message in text, text
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("overrides, message", [
    # a typo inside model.config is named with the key it most resembles
    (["model.config.num_hiden_layers=4"],
     "model.config.num_hiden_layers: not a key of LlamaConfig (transformers would ignore it); did you mean "
     "num_hidden_layers?"),
    (["model.config.model_type=lama"], "model.config.model_type: transformers knows no architecture 'lama'; "
                                       "did you mean llama?"),
    # booleans are not numbers (pydantic's lax mode reads true as 1)
    (["training.max_steps=true"], "training.max_steps: expected a number, not the boolean true"),
    (["training.tiled_mlp=true"], "training.tiled_mlp: expected a number, not the boolean true"),
    (["training.lr=true"], "training.lr: expected a number, not the boolean true"),
    (["model.config.hidden_size=true"], "model.config.hidden_size: must be a positive integer; got True"),
    (["model.config.rms_norm_eps=true"],
     "model.config.rms_norm_eps: expected a number, not the boolean true"),
    # numbers bounded where the library needs them bounded
    (["training.timeout_s=1e30"], "training.timeout_s: input should be less than or equal to 2592000"),
    (["training.seed=1180591620717411303424"], "training.seed: input should be less than 4294967296"),
    (["data.synthetic.seed=-1"], "data.synthetic.seed: input should be greater than or equal to 0"),
    (["training.batch_size=1000000000000"], "training.batch_size 1000000000000 x context_length 4096: one "
                                           "micro-batch's token tensors alone take"),
    (["model.config.rope_theta=.nan"], "model.config.rope_theta: must be a finite number; got nan"),
    (["model.config.rope_theta=-1.0"], "model.config.rope_theta: must be a positive number; got -1.0"),
    (["model.config.num_attention_heads=0"], "model.config.num_attention_heads: must be a positive integer"),
    (["model.config.head_dim=null", "model.config.hidden_size=65"],
     "model.config: hidden_size 65 is not divisible by num_attention_heads 2; set head_dim"),
    # the byte tokenizer's 257 ids against tiny.yaml's 256-entry embedding (the README's own-text recipe)
    (["data.type=files", "data.paths=[README.md]", "tokenizer=bytes"],
     "tokenizer: the byte tokenizer produces 257 ids (256 bytes and end-of-text) but the model's vocab_size "
     "is 256; set model.config.vocab_size=257 (or more)"),
])
def test_config_mistakes_are_one_line_errors(overrides: list[str], message: str) -> None:
    _refused(TINY, overrides, message)


def test_yaml_duplicates_formats_and_the_plan(tmp_path: Path, capsys) -> None:
    from lightseq_hf.training.cli import main

    twice = tmp_path / "twice.yaml"
    twice.write_text((ROOT / "configs" / "tiny.yaml").read_text() + "training:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"key 'training' appears twice in one mapping \(lines \d+ and "
                                          r"\d+\); the second would silently replace the first: merge them"):
        load_config(twice)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "a b c"}\n')
    _refused(TEXT, [f"data.paths=[{rows}]"], f"data.paths[0]: '{rows}' is a json file but data.format is "
                                             "'text'; set data.format=json (or auto)")
    config_from_dict(TEXT, [f"data.paths=[{rows}]", "data.format=auto"], base_dir=ROOT / "configs")
    cfg = str(ROOT / "configs" / "tiny.yaml")
    assert main([cfg, "model.config.num_attention_heads=0", "--plan", "--world-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lightseq-finetune: config error: model.config.num_attention_heads: must be a positive "
                   "integer; got 0"], err
    from lightseq_hf.planner import ModelShape

    with pytest.raises(ValueError, match="num_attention_heads must be a positive integer; got 0"):
        ModelShape.from_config({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                "num_attention_heads": 0, "vocab_size": 256})


def test_check_says_what_it_checked(tmp_path: Path, capsys) -> None:
    from lightseq_hf.training.cli import main

    out_dir = tmp_path / "run"
    tiny = str(ROOT / "configs" / "tiny.yaml")
    assert main([tiny, f"output_dir={out_dir}", "--check", "--world-size", "2"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) == 1 and captured.err == "", captured
    assert lines[0].startswith("lightseq-finetune: check passed: ")
    for part in ("schema, types and ranges", "world 2 = 1 data-parallel x 2 sequence-parallel, 2048 tokens "
                 "per rank", "model.config (llama, keys checked)", "data synthetic",
                 f"output_dir {out_dir} writable, fresh start"):
        assert part in lines[0], lines[0]
    assert not out_dir.exists()  # a check creates nothing


def test_tokenizer_against_vocabulary_and_integer_data() -> None:
    from lightseq_hf.training.build import check_tokenizer_fits
    from lightseq_hf.training.data import collate

    class Tok:  # a Hugging Face tokenizer with added tokens: len() counts them
        def __len__(self) -> int:
            return 300

    cfg = config_from_dict(TEXT, base_dir=ROOT / "configs")
    cfg.tokenizer = "some/tokenizer"
    with pytest.raises(ConfigError, match="tokenizer: some/tokenizer produces 300 ids but "
                                          "model.config.vocab_size is 257; set model.config.vocab_size=300"):
        check_tokenizer_fits(cfg, Tok(), 257)
    check_tokenizer_fits(cfg, Tok(), 300)
    # fractional boundaries or ids are refused, not truncated (3.5 -> 3 would move a document boundary)
    with pytest.raises(ValueError, match=r"data: position_ids must hold whole numbers; found 3.5"):
        collate([{"input_ids": [1, 2, 3], "position_ids": [0.0, 1.0, 3.5]}])
    with pytest.raises(ValueError, match="data: input_ids must hold whole numbers; found nan"):
        collate([{"input_ids": [1.0, float("nan")]}])
    whole = collate([{"input_ids": [1, 2], "position_ids": torch.tensor([0.0, 1.0])}])
    assert whole["position_ids"].dtype == torch.long and whole["position_ids"].tolist() == [[0, 1]]


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
