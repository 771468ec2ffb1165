"""Inputs that would fail deep inside torch or give a quietly mixed result, each refused with one line
that names the problem and the fix: labels outside the model's output vocabulary (a device-side
assert on a GPU), ``position_ids`` that restart where ``cu_seq_lens_q/k`` start no document (neither
reading is the caller's), a group this rank is not a member of, a directory given as the config file,
attention dropout in ``model.config``, and a ``training.backend`` that cannot run on the run's device.
Inputs next to them that are well-formed still give the unpatched model's numbers. A warmup longer than
the run is legal but says that the learning rate never reaches ``training.lr``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from distributed import rel_err, run_distributed
from tiny_models import VOCAB, make_batch, make_model

import lightseq_hf
from lightseq_hf.training.config import ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())


def _one_line(excinfo: pytest.ExceptionInfo, needle: str) -> None:
    text = str(excinfo.value)
    assert needle in text, text
    assert "\n" not in text, text


def _labels_worker(rank: int, world: int) -> list[str]:
    failures = []
    model = make_model(layers=1)
    ids, labels = make_batch(2, 12, 0)
    with torch.no_grad():
        want = copy.deepcopy(model).double()(input_ids=ids, labels=labels).loss
    lightseq_hf.patch(model)
    try:
        for bad, token in ((labels.clamp(max=0) + VOCAB + 3, VOCAB + 3), (torch.full_like(labels, -1), -1)):
            try:
                model(input_ids=ids, labels=bad)
                failures.append(f"rank {rank}: labels holding {token} were not refused")
            except ValueError as e:
                text = str(e)
                needle = f"labels hold token id {token}, outside the model's output vocabulary of {VOCAB}"
                if needle not in text or "\n" in text:
                    failures.append(f"rank {rank}: {text}")
        with torch.no_grad():
            got = model(input_ids=ids, labels=labels).loss  # -100 and in-vocabulary ids still pass
            none = model(input_ids=ids, labels=torch.full_like(labels, -100)).loss
        if rel_err(got, want) > 1e-5 or not torch.isnan(none):
            failures.append(f"rank {rank}: loss {got} vs {want}; all-ignored loss {none}")
    finally:
        lightseq_hf.unpatch()
    return failures


def test_labels_outside_the_vocabulary_are_refused_on_every_rank() -> None:
    assert run_distributed(_labels_worker, 2) == [[], []]


def test_position_ids_must_restart_where_cu_seq_lens_start_documents() -> None:
    ids, _ = make_batch(1, 12, 3)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]  # documents [0, 5) and [5, 12)
    model = make_model(layers=1)
    ref = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        want = torch.cat([ref(input_ids=ids[:, :5]).logits, ref(input_ids=ids[:, 5:]).logits], 1)
    lightseq_hf.patch(model)
    try:
        model.eval()
        with torch.no_grad(), pytest.raises(ValueError) as e:
            other = torch.tensor([0, 6, 12])
            model(input_ids=ids, position_ids=pos, cu_seq_lens_q=other, cu_seq_lens_k=other)
        _one_line(e, "position_ids restart at token 5 of row 0, where cu_seq_lens_q/k start no document")
        same = torch.tensor([0, 5, 12], dtype=torch.int32)
        with torch.no_grad():
            for kwargs in (dict(position_ids=pos), dict(position_ids=torch.arange(12)[None]), {}):
                got = model(input_ids=ids, cu_seq_lens_q=same, cu_seq_lens_k=same, **kwargs).logits
                assert rel_err(got, want) < 1e-5, kwargs  # agreeing (or continuous) positions are fine
    finally:
        lightseq_hf.unpatch()


def test_a_group_this_rank_is_not_in_is_named() -> None:
    outside = dist.GroupMember.NON_GROUP_MEMBER  # what new_group returns on the ranks it leaves out
    q = torch.randn(1, 8, 2, 8)
    needle = "this rank is not a member of the process group passed"
    for call in (lambda: lightseq_hf.dist_flash_attn(q, q, q, group=outside),
                 lambda: lightseq_hf.sync_gradients(torch.nn.Linear(2, 2), group=outside),
                 lambda: lightseq_hf.patch(make_model(layers=1), sp_group=outside)):
        with pytest.raises(ValueError) as e:
            call()
        _one_line(e, needle)


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


def test_pad_to_multiple_names_a_missing_dimension() -> None:
    with pytest.raises(ValueError) as e:
        lightseq_hf.pad_to_multiple(torch.arange(5), 4)  # 1-D: there is no sequence dim 1
    _one_line(e, "dim=1 is not a dimension of x, of shape (5,); the sequence is dim 1 of (batch, seq, ...)")
    assert lightseq_hf.pad_to_multiple(torch.arange(5), 4, dim=0).tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert lightseq_hf.pad_to_multiple(torch.ones(1, 5), 4, dim=-1).shape == (1, 8)


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
