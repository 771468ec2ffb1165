"""Fine-tuning config: YAML loading, dotted overrides, and validation errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lightseq_hf.training.config import ConfigError, config_from_dict, load_config, parse_overrides
from lightseq_hf.training.shape import run_shape

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def base() -> dict:
    return {
        "context_length": 4096,
        "sp_size": 2,
        "model": {"config": {"model_type": "llama", "vocab_size": 257, "hidden_size": 64}},
        "training": {"max_steps": 10},
    }


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.context_length % (cfg.sp_size or 1) == 0


def test_overrides_apply_with_yaml_types(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(base()))
    cfg = load_config(p, ["training.max_steps=3", "training.lr=1e-4", "output_dir=/tmp/x",
                          "logging.plot=false", "sp_size=null", "training.betas=[0.8, 0.9]",
                          "model.config.num_hidden_layers=3"])
    assert cfg.training.max_steps == 3 and cfg.training.lr == pytest.approx(1e-4)
    assert cfg.output_dir == "/tmp/x" and cfg.logging.plot is False and cfg.sp_size is None
    assert cfg.training.betas == [0.8, 0.9]
    assert cfg.model.config["num_hidden_layers"] == 3
    assert parse_overrides(["a.b=1", "c=hello"]) == [("a.b", 1), ("c", "hello")]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["training.bogus=1"], "training.bogus"),
        (["bogus=1"], "bogus"),
        (["data.synthetic.nope=1"], "data.synthetic.nope"),
        (["context_length=4097"], "context_length"),
        (["training.lr=fast"], "training.lr"),
        (["training.max_steps=0"], "training.max_steps"),
        (["training.checkpointing=sometimes"], "training.checkpointing"),
        (["training.backend=cuda"], "training.backend"),
        (["model.path=/no/such/model"], "model.path"),
        (["tokenizer=/no/such/tokenizer"], "tokenizer"),
        (["data.type=files", "data.paths=[/no/such/file.jsonl]", "tokenizer=bytes"], "data.paths[0]"),
        (["data.type=files"], "data.paths"),
        (["saving.resume_from=/no/such/checkpoint"], "saving.resume_from"),
        (["logging.plot=maybe"], "logging.plot"),
        (["training=3"], "training"),
        (["model.config.vocab_size=10"], "model.config.vocab_size"),
    ],
)
def test_validation_errors_name_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        config_from_dict(base(), overrides)
    assert key in str(e.value), str(e.value)


def test_sp_size_must_divide_world() -> None:
    config_from_dict(base(), world_size=4)
    with pytest.raises(ConfigError, match="sp_size 2 does not divide the world size 3"):
        config_from_dict(base(), world_size=3)
    with pytest.raises(ConfigError, match="context_length 4096 is not divisible by sp_size 3"):
        config_from_dict(base(), ["sp_size=null"], world_size=3)


def test_run_shape_of_the_tiny_config() -> None:
    """configs/tiny.yaml (4096 tokens, sp_size 2, batch_size 2, grad_accum 1) on 4 processes: 2 groups of 2
    ranks, 2048 tokens a rank, 2 x 1 x 2 sequences a step; a frozen value; refused where sizes do not
    divide, with the config's own message."""
    import dataclasses

    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    shape = run_shape(cfg, 4)
    assert (shape.context_length, shape.sp_size, shape.dp_size, shape.world_size) == (4096, 2, 2, 4)
    assert (shape.batch_size, shape.grad_accum) == (2, 1)
    assert shape.tokens_per_rank == 2048
    assert shape.sequences_per_step == 4 and shape.tokens_per_step == 4 * 4096
    assert shape.describe() == "world 4 = 2 data-parallel x 2 sequence-parallel"
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.sp_size = 4  # type: ignore[misc]
    every_rank = load_config(ROOT / "configs" / "tiny.yaml", ["sp_size=null"])
    shape = run_shape(every_rank, 4)
    assert (shape.sp_size, shape.dp_size, shape.tokens_per_rank) == (4, 1, 1024)
    with pytest.raises(ConfigError) as e:
        run_shape(cfg, 3)
    assert str(e.value) == ("sp_size 2 does not divide the world size 3 (launched processes); choose one "
                            "of 1, 3")
    with pytest.raises(ConfigError) as e:
        run_shape(every_rank, 3)
    assert str(e.value) == ("context_length 4096 is not divisible by sp_size 3: every rank of a "
                            "sequence-parallel group holds context_length / sp_size tokens")


def test_missing_model_and_bad_override_syntax(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model"):
        config_from_dict({"context_length": 128})
    with pytest.raises(ConfigError, match="key.sub=value"):
        config_from_dict(base(), ["training.max_steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_relative_paths_resolve_against_the_config(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "hi"}\n')
    cfg_dir = tmp_path / "configs"
    cfg_dir.mkdir()
    d = base() | {"tokenizer": "bytes", "data": {"type": "files", "paths": ["data/a.jsonl"]}}
    (cfg_dir / "c.yaml").write_text(yaml.safe_dump(d))
    cfg = load_config(cfg_dir / "c.yaml")
    assert Path(cfg.data.paths[0]).is_file()


def test_cli_reports_config_errors(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    from lightseq_hf.training.cli import main

    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(base()))
    assert main([str(p), "training.nope=1"]) == 2
    assert "training.nope" in capsys.readouterr().err
    assert main([str(p), "--print-config"]) == 0
