"""Mistakes in the YAML config and on the command line, each refused with one line that names the problem
and the fix (or legal and said aloud): keys and values of ``model.config`` and ``training``, unbounded
numbers, duplicate keys and formats, what ``--check`` checked, a directory given as the config, attention
dropout, a backend that cannot run on the run's device, a warmup longer than the run, and command-line
numbers, data files and resume paths that cannot work."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import yaml

from lightseq_hf.training.config import ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
TINY_PATH = str(ROOT / "configs" / "tiny.yaml")
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


def _one_line(excinfo: pytest.ExceptionInfo, needle: str) -> None:
    text = str(excinfo.value)
    assert needle in text, text
    assert "\n" not in text, text


def test_config_directory_and_attention_dropout_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    _one_line(e, f"config file {tmp_path} is a directory; pass a YAML file")
    for key in ("attention_dropout", "attn_pdrop"):
        data = copy.deepcopy(TINY)
        if key == "attn_pdrop":  # GPT-2 names its attention dropout attn_pdrop
            data["model"]["config"] = {"model_type": "gpt2", "n_embd": 64, "n_head": 2, "n_layer": 1,
                                       "vocab_size": 256}
        with pytest.raises(ConfigError) as e:
            config_from_dict(data, [f"model.config.{key}=0.1"], base_dir=ROOT / "configs")
        _one_line(e, f"model.config.{key}: 0.1; lightseq_hf's distributed attention has no dropout; set "
                     f"model.config.{key}=0.0")
    config_from_dict(TINY, ["model.config.attention_dropout=0.0"], base_dir=ROOT / "configs")


def test_backend_that_cannot_run_on_the_device_is_a_config_error() -> None:
    from lightseq_hf.training.build import check_backend_device

    model = torch.nn.Linear(2, 2)  # on the CPU
    with pytest.raises(ConfigError) as e:
        check_backend_device("flash_varlen", model)
    _one_line(e, "training.backend: 'flash_varlen' ")
    assert "tensors are on cpu; set training.backend=auto (or reference)" in str(e.value)
    for backend in ("auto", "reference"):
        check_backend_device(backend, model)


def test_warmup_longer_than_the_run_says_so(caplog) -> None:
    from lightseq_hf.training.build import build_optimizer

    cfg = config_from_dict(copy.deepcopy(TINY), ["training.warmup_steps=40", "training.lr=1e-3"],
                           base_dir=ROOT / "configs")
    caplog.set_level("WARNING", logger="lightseq_hf")
    optimizer, scheduler = build_optimizer(torch.nn.Linear(4, 4), cfg, 10)
    said = "training.warmup_steps=40 exceeds the run's 10 steps: the learning rate peaks at 0.00025"
    assert said in caplog.text
    for _ in range(9):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)  # the peak the warning names


def _cli_error(capsys, argv: list[str]) -> str:
    from lightseq_hf.training.cli import main

    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def test_cli_numbers_must_be_positive(tmp_path: Path, capsys) -> None:
    out = f"output_dir={tmp_path / 'run'}"
    for argv, needle in (
        (["--check", "--world-size", "0"], "--world-size must be at least 1; got 0"),
        (["--check", "--world-size", "-2"], "--world-size must be at least 1; got -2"),
        (["--plan", "--gpu-gib", "nan"], "--gpu-gib must be a positive number of GiB; got nan"),
        (["--plan", "--gpu-gib", "-1"], "--gpu-gib must be a positive number of GiB; got -1.0"),
        (["--plan", "--host-gib", "0"], "--host-gib must be a positive number of GiB; got 0.0"),
    ):
        assert needle in _cli_error(capsys, [TINY_PATH, out, *argv])


def test_cli_check_finds_unusable_data_files_and_resume_paths(tmp_path: Path, capsys) -> None:
    empty, blob, folder = tmp_path / "empty.txt", tmp_path / "data.bin", tmp_path / "docs"
    empty.write_text("")
    blob.write_bytes(b"abc")
    folder.mkdir()
    text = ["data.type=files", "tokenizer=bytes", "model.config.vocab_size=257",
            f"output_dir={tmp_path / 'run'}", "--check"]
    for extra, needle in (
        ([f"data.paths=[{empty}]"], "data.paths: every data file is empty; add documents to them"),
        ([f"data.paths=[{folder}]"], f"data.paths[0]: '{folder}' is a directory; list the data files in it"),
        ([f"data.paths=[{blob}]"], f"data.paths: cannot tell the format of '{blob}' from its extension; set "
                                   "data.format"),
        ([f"data.paths=[{ROOT / 'README.md'}]", f"saving.resume_from={empty}"],
         f"saving.resume_from: '{empty}' is a file, not a checkpoint directory"),
    ):
        assert needle in _cli_error(capsys, [TINY_PATH, *text, *extra])
