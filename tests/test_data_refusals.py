"""Token data that cannot train the model, refused with one line naming the problem and the fix wherever it
is found: a tokenizer whose ids the model's vocabulary cannot hold, non-integer token data, and problems
the workers find after the launch (the main process's first block, a two-process launch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightseq_hf.training.config import ConfigError, config_from_dict

ROOT = Path(__file__).resolve().parents[1]
TINY_PATH = str(ROOT / "configs" / "tiny.yaml")
TEXT = yaml.safe_load((ROOT / "configs" / "tiny-text.yaml").read_text())


def _one_line(excinfo: pytest.ExceptionInfo, needle: str) -> None:
    text = str(excinfo.value)
    assert needle in text, text
    assert "\n" not in text, text

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


def test_data_problems_found_by_the_workers_are_config_errors() -> None:
    """A worker prints a ConfigError as one line and exits 2; other errors end in a traceback."""
    import datasets

    from lightseq_hf.training.data import ByteTokenizer, detect_format, tokenize_and_pack

    with pytest.raises(ConfigError, match="the data holds fewer than context_length=64 tokens"):
        tokenize_and_pack(datasets.Dataset.from_dict({"text": ["ab"]}), ByteTokenizer(), 64)
    with pytest.raises(ConfigError, match="cannot tell the format"):
        detect_format(["notes.bin"])
    for texts, shown in (([None, "hello world"], "NoneType values (such as None)"), ([5], "int values")):
        with pytest.raises(ConfigError) as e:  # an AttributeError inside the tokenizer otherwise
            tokenize_and_pack(datasets.Dataset.from_dict({"text": texts}), ByteTokenizer(), 4)
        _one_line(e, f"data.text_field: column 'text' holds {shown}")


def test_data_refusal_leaves_the_main_process_first_block(tmp_path: Path) -> None:
    """The main rank builds the dataset while the others wait for it at the end of the block: a refusal must
    leave the block normally (else the waiting ranks crash on the closed connection with a traceback)."""
    import contextlib

    import yaml

    from lightseq_hf.training.config import config_from_dict
    from lightseq_hf.training.data import ByteTokenizer, build_text_dataset

    short = tmp_path / "short.txt"
    short.write_text("ab")
    cfg = config_from_dict(yaml.safe_load(Path(TINY_PATH).read_text()),
                           ["data.type=files", f"data.paths=[{short}]", "tokenizer=bytes",
                            "model.config.vocab_size=257", "context_length=64"], base_dir=ROOT / "configs")
    left = []

    @contextlib.contextmanager
    def main_process_first():
        yield
        left.append(True)  # the barrier the other ranks wait at

    with pytest.raises(ConfigError, match="the data holds fewer than context_length=64 tokens"):
        build_text_dataset(cfg.data, cfg.context_length, ByteTokenizer(), main_process_first)
    assert left == [True]


@pytest.mark.slow


def test_data_refused_after_a_two_process_launch_is_one_line(tmp_path: Path) -> None:

    short = tmp_path / "short.txt"
    short.write_text("ab")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "scripts/finetune.py", "--nproc", "2", TINY_PATH,
                           "training.device=cpu", "data.type=files", f"data.paths=[{short}]",
                           "tokenizer=bytes",
                           "model.config.vocab_size=257", "context_length=64",
                           f"output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lightseq-finetune:")]
    assert lines == ["lightseq-finetune: config error: the data holds fewer than context_length=64 tokens "
                     "per packing batch; add data or lower context_length"], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "[rank1]" not in proc.stderr, proc.stderr
