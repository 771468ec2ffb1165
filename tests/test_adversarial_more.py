"""More inputs a new user (or an adversary) passes to the public surface, each refused with one line that
names the problem and the fix instead of a silent wrong result or a deep traceback: cu_seqlens that are not
whole numbers or not 1-D, Segments of the wrong types, non-boolean ``causal``, non-numeric scales, the
patched model's ids, embeddings and labels of the wrong kind, ``check_parity`` options that would pass
anything, and command-line numbers, data files and resume paths that cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightseq_hf
from lightseq_hf import Segments
from lightseq_hf.training.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 8, 2, 8, generator=g) for _ in range(3))


def _one_line(excinfo: pytest.ExceptionInfo, needle: str) -> None:
    text = str(excinfo.value)
    assert needle in text, text
    assert "\n" not in text, text


CU_MESSAGE = "cu_seqlens must be a 1-D list or tensor of whole token counts"


@pytest.mark.parametrize("cu", [
    torch.tensor([0.0, 3.5, 8.0]),          # int() would cut it to [0, 3, 8]
    [0, 3.5, 8],
    torch.tensor([[0, 3, 8]]),
    torch.tensor([False, True]),            # int() would read it as [0, 1]
    "0,3,8",
    torch.tensor([0, 3, 8], device="meta"),
], ids=["float-tensor", "float-list", "2-D", "bool", "string", "meta"])
def test_cu_seqlens_must_be_whole_numbers(cu) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=cu)
    _one_line(e, CU_MESSAGE)


def test_whole_number_cu_seqlens_of_any_kind_agree() -> None:
    import numpy as np

    q, k, v = _qkv()
    want = lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, 3, 8])
    for cu in (torch.tensor([0.0, 3.0, 8.0]), torch.tensor([0, 3, 8], dtype=torch.int32), (0, 3, 8),
               np.array([0, 3, 8])):
        torch.testing.assert_close(lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=cu), want)


@pytest.mark.parametrize("length, docs", [
    (8.0, (((0, 3), (3, 8)),)),
    (8, (((0, 3.5), (3.5, 8)),)),
    (8, ((0, 3), (3, 8))),                  # one row without its nesting
])
def test_segments_need_int_pairs_per_row(length, docs) -> None:
    with pytest.raises(ValueError) as e:
        Segments(length, docs)
    _one_line(e, "Segments takes an int length and, per batch row, a sequence of (start, stop) int pairs")


def test_segments_normalise_lists_and_integer_tensors() -> None:
    seg = Segments(8, [[(torch.tensor(0), torch.tensor(3)), [3, 8]]])
    assert seg == Segments(8, (((0, 3), (3, 8)),)) and isinstance(seg.docs[0][0][1], int)
    q, k, v = _qkv()
    torch.testing.assert_close(lightseq_hf.dist_flash_attn(q, k, v, segments=seg),
                               lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, 3, 8]))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(causal=None), "causal must be True or False; got None"),        # falsy: would mean non-causal
    (dict(causal="False"), "causal must be True or False; got 'False'"),
    (dict(softmax_scale="0.3"), "softmax_scale must be a number (or None); got '0.3'"),
])
def test_flag_and_scale_types(kwargs: dict, needle: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        lightseq_hf.dist_flash_attn(q, k, v, **kwargs)
    _one_line(e, needle)


def test_group_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError) as e:
        lightseq_hf.pad_to_multiple(torch.zeros(1, 5), 0)
    _one_line(e, "multiple must be a positive int (the group size); got 0")
    with pytest.raises(ValueError) as e:
        lightseq_hf.pad_to_multiple(torch.zeros(1, 5), -2)
    _one_line(e, "multiple must be a positive int")
    for world in ("3", 2.0):
        with pytest.raises(ValueError) as e:
            lightseq_hf.build_schedule(world)
        _one_line(e, f"world size must be an int >= 1, got {world!r}")
    with pytest.raises(ValueError) as e:
        lightseq_hf.segments_from_hf(batch=1, length=4, position_ids=torch.tensor([[0, 0.5, 1, 2]]))
    _one_line(e, "position_ids must be whole numbers")  # .long() would read [0, 0, 1, 2]: two documents
    assert lightseq_hf.segments_from_hf(batch=1, length=4, position_ids=torch.tensor([[0.0, 1, 0, 1]])) == \
        Segments(4, (((0, 2), (2, 4)),))
    with pytest.raises(ValueError) as e:
        lightseq_hf.init_sequence_parallel(0)
    _one_line(e, "sp_size must be a positive int (ranks per sequence) or None (every rank); got 0")


def test_groups_must_be_process_groups() -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError) as e:
        lightseq_hf.dist_flash_attn(q, k, v, group=3)
    _one_line(e, "group must be a torch.distributed.ProcessGroup or None (the world); got int")
    with pytest.raises(ValueError) as e:
        lightseq_hf.sync_gradients(torch.nn.Linear(2, 2), group=3)
    _one_line(e, "group must be a torch.distributed.ProcessGroup or None (all ranks); got int")


@pytest.fixture
def patched():
    from tiny_models import make_model

    model = lightseq_hf.patch(make_model(layers=1))
    try:
        yield model
    finally:
        lightseq_hf.unpatch()


def test_patched_model_refuses_malformed_inputs(patched) -> None:
    from tiny_models import make_batch

    ids, labels = make_batch(2, 12, 0)
    cases = [
        (dict(input_ids=ids[0]), "input_ids must be a 2-D (batch, seq) integer tensor; got shape (12,)"),
        (dict(input_ids=ids.float()), "input_ids must be a 2-D (batch, seq) integer tensor; got shape "
                                      "(2, 12), dtype torch.float32"),
        (dict(input_ids=ids.to(torch.uint8)), "dtype torch.uint8 (add a batch dimension"),
        (dict(inputs_embeds=torch.randn(12, 64)), "inputs_embeds must be 3-D (batch, seq, hidden); got shape "
                                                  "(12, 64)"),
        (dict(input_ids=ids[:, :0]), "the inputs hold no tokens (shape (2, 0))"),
        (dict(input_ids=ids, labels=labels.float()), "labels must be integer token ids (int64, -100 where no "
                                                     "loss is taken); got dtype torch.float32"),
        (dict(input_ids=ids[:1], cu_seq_lens_q=torch.tensor([0, 5.5, 12]),
              cu_seq_lens_k=torch.tensor([0, 5.5, 12])), CU_MESSAGE),  # int() would split at 5
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError) as e:
            patched(**kwargs)
        _one_line(e, needle)
    out = patched(input_ids=ids, labels=labels)  # the well-formed call still runs
    assert torch.isfinite(out.loss)


def test_check_parity_refuses_options_that_pass_anything(patched) -> None:
    from tiny_models import make_batch

    ids, _ = make_batch(2, 12, 0)
    cases = [
        (dict(rtol=float("nan")), "rtol must be a positive finite number"),   # no error exceeds nan
        (dict(rtol=-1.0), "rtol must be a positive finite number"),
        (dict(max_tokens=0), "max_tokens must be a positive int"),
        (dict(max_tokens=-5), "max_tokens must be a positive int"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError) as e:
            lightseq_hf.check_parity(patched, {"input_ids": ids}, **kwargs)
        _one_line(e, needle)
    for length in (0, 1):  # no next-token label: the losses are NaN
        with pytest.raises(ValueError) as e:
            lightseq_hf.check_parity(patched, {"input_ids": ids[:, :length]})
        _one_line(e, "the parity check needs rows of at least 2 tokens (a next-token loss); the batch's "
                     f"rows have {length}")


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
        assert needle in _cli_error(capsys, [TINY, out, *argv])


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
        assert needle in _cli_error(capsys, [TINY, *text, *extra])


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
    cfg = config_from_dict(yaml.safe_load(Path(TINY).read_text()),
                           ["data.type=files", f"data.paths=[{short}]", "tokenizer=bytes",
                            "model.config.vocab_size=257", "context_length=64"], base_dir=ROOT / "configs")
    left = []

    @contextlib.contextmanager
    def main_process_first():
        yield
        left.append(True)  # the barrier the other ranks wait at

    with pytest.raises(ConfigError, match="the data holds fewer than context_length=64 tokens"):
        build_text_dataset(cfg, ByteTokenizer(), main_process_first)
    assert left == [True]


@pytest.mark.slow
def test_data_refused_after_a_two_process_launch_is_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    short = tmp_path / "short.txt"
    short.write_text("ab")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "scripts/finetune.py", "--nproc", "2", TINY, "training.device=cpu",
                           "data.type=files", f"data.paths=[{short}]", "tokenizer=bytes",
                           "model.config.vocab_size=257", "context_length=64",
                           f"output_dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lightseq-finetune:")]
    assert lines == ["lightseq-finetune: config error: the data holds fewer than context_length=64 tokens "
                     "per packing batch; add data or lower context_length"], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "[rank1]" not in proc.stderr, proc.stderr


def _shard_inputs_worker(rank: int, world: int) -> list[str]:
    """On two ranks: a shard's own cu_seqlens is refused on every rank, the full rows' and explicit
    Segments run; token ids outside the vocabulary are refused on every rank before any work."""
    from tiny_models import VOCAB, make_batch, make_model

    failures: list[str] = []

    def refused(call, needle: str) -> None:
        try:
            call()
            failures.append(f"rank {rank}: accepted, expected {needle!r}")
        except ValueError as e:
            if needle not in str(e) or "\n" in str(e):
                failures.append(f"rank {rank}: {e}")

    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, 8, 2, 8, generator=g) for _ in range(3))
    refused(lambda: lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, 3, 8]),
            "cu_seqlens ends at 8, the size of one rank's shard (1 x 8 tokens)")
    padded = lightseq_hf.dist_flash_attn(q, k, v, segments=Segments.from_cu_seqlens([0, 3, 8], 1, 16))
    if rank == 1 and bool(padded.any()):
        failures.append("rank 1: the padding of explicit Segments did not output 0")
    if not torch.isfinite(lightseq_hf.dist_flash_attn(q, k, v, cu_seqlens=[0, 3, 16])).all():
        failures.append(f"rank {rank}: the full rows' cu_seqlens gave non-finite output")

    model = lightseq_hf.patch(make_model(layers=1))
    ids, labels = make_batch(1, 12, 0)
    for bad, shown in ((VOCAB, VOCAB), (-1, -1)):
        wrong = ids.clone()
        wrong[0, 9] = bad  # on rank 1's half: rank 0 alone would never see it
        refused(lambda: model(input_ids=wrong, labels=labels),
                f"input_ids hold token id {shown}, outside the model's vocabulary of {VOCAB}")
    if not torch.isfinite(model(input_ids=ids, labels=labels).loss):
        failures.append(f"rank {rank}: the well-formed batch after the refusals did not run")
    lightseq_hf.unpatch()
    return failures


def test_shard_cu_seqlens_and_unknown_token_ids_are_refused_on_every_rank() -> None:
    from distributed import run_distributed

    assert run_distributed(_shard_inputs_worker, 2) == [[], []]
