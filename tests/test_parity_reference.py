"""The parity check's reference is the unpatched model, so it shares no bug with the patch.

* Every model type the support table calls exact passes ``check_parity`` with its defaults (one spawned
  group of 2 gloo processes, a tiny random model of each type): a packed row with right padding (the
  reference gives the model each document alone) and plain rows with right padding (the reference runs
  them as they are).
* Correct runs that a reference built on the patch's own attention would stop pass, on 2 and 3
  processes: Gemma 2 soft-capping (at 2.0, and at Gemma 2's 50 with small weights), gpt-oss sinks, Llama
  4 chunked layers, packed Gemma 2 and gpt-oss, PhiMoE's sampled routing and OPT's functional dropout in
  training mode, a left-padded batch whose first row begins with a prefix of padding, a user's own
  registered attention function that the patch serves exactly.
* Wrong runs fail on every rank with one line naming what: soft-capping dropped or the loss scaled by
  the patch (bugs a reference built from the patch's own forward shares), OPT with left padding wherever
  the patched model differs from the unpatched one, a user's attention function replaced by the
  patch's, a gradient sync that sums (2x gradients), groups of one rank under a launch of several; on 4
  processes (2 data-parallel groups of 2), a sync that leaves the data-parallel groups apart.
* A Trainer with ``ParityCallback`` on a correct left-padded dataset trains; a Gemma 2 fine-tune through
  ``lightseq-finetune`` (parity on by default) passes its first step.
* An unsplit launch (``WORLD_SIZE`` > 1, no process group) is refused by ``patch(model)``, a patched
  forward, ``check_parity`` and ``init_sequence_parallel``, with the call that fixes it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from distributed import run_distributed
from model_table import RESULTS

ROOT = Path(__file__).resolve().parents[1]


def _exact_types() -> list[str]:
    rows = json.loads(RESULTS.read_text())["rows"]
    return sorted(t for t, row in rows.items() if row["status"] == "works")


def _packed_and_padded() -> dict:
    """One row of 23 tokens: two packed documents (9 and 10 tokens), then 4 tokens of padding."""
    ids = torch.randint(3, 120, (1, 23), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[:, 19:] = 0
    positions = torch.cat([torch.arange(9), torch.arange(14)])[None]
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 9] = -100  # a document's first token is not predicted from the one before
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "labels": labels}


def _padded_rows(rows: int = 2, length: int = 12, pad: int = 4, left: bool = False, seed: int = 2) -> dict:
    """Rows of ``length`` tokens, the first padded by ``pad`` tokens on the right (or every row on the
    left, the first real token unsupervised as collators leave it)."""
    ids = torch.randint(3, 120, (rows, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if left:
        mask[:, :pad] = 0
    else:
        mask[0, length - pad:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if left:
        labels[:, pad] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _check(model, batch: dict, **options) -> dict:
    import lightseq_hf

    return lightseq_hf.check_parity(model, batch, sync=options.pop("sync", lightseq_hf.sync_gradients),
                                    **options)


def _every_type_worker(rank: int, world: int, types: list[str]) -> list[str]:
    import logging

    from tiny_models import make_tiny

    import lightseq_hf

    logging.getLogger("lightseq_hf").setLevel(logging.ERROR)
    failures = []
    for model_type in types:
        model = lightseq_hf.patch(make_tiny(model_type).train())
        for name, batch in (("packed", _packed_and_padded()), ("padded", _padded_rows())):
            try:
                report = _check(model, batch)
                if report["tokens"] != batch["input_ids"].numel() or report["reference_attention"] != "eager":
                    failures.append(f"{model_type} {name}: report {report}")
            except Exception as exc:  # noqa: BLE001  (the peers run the same cases in the same order)
                failures.append(f"{model_type} {name}: {type(exc).__name__}: {exc}")
        lightseq_hf.unpatch()
    return failures


def test_every_exact_model_type_passes_by_default():
    types = _exact_types()
    assert len(types) > 80 and {"gemma2", "gpt_oss", "llama4_text", "opt", "phimoe"} <= set(types)
    failures = [f for result in run_distributed(_every_type_worker, 2, types) for f in result]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- correct runs, wrong runs


def _scaled_down(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(0.1)


def _large_scores(model) -> None:
    """Query and key projections x10: attention logits of several units, where a cap of 2 bends them."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(10)


def _random_sinks(model) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0, 1, generator=torch.Generator().manual_seed(3))


def _register_attention(name: str, scale: float) -> None:
    """A user's attention function: Transformers' SDPA with the scaling multiplied by ``scale``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        scaling = (scaling if scaling is not None else query.shape[-1] ** -0.5) * scale
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)


#: (name, model type, tiny-config overrides, attention, prepare the model, batch)
CORRECT = [
    ("gemma2 soft-cap 2", "gemma2", dict(attn_logit_softcapping=2.0), "eager", _large_scores, _padded_rows),
    ("gemma2 soft-cap 50, small weights", "gemma2", dict(attn_logit_softcapping=50.0), "eager",
     _scaled_down, _padded_rows),
    ("gemma2 packed", "gemma2", dict(attn_logit_softcapping=2.0), "eager", _large_scores,
     _packed_and_padded),
    ("gpt-oss sinks", "gpt_oss", {}, "eager", _random_sinks, _padded_rows),
    ("gpt-oss sinks packed", "gpt_oss", {}, "eager", _random_sinks, _packed_and_padded),
    ("llama4 chunked layers", "llama4_text", {}, "eager", None, lambda: _padded_rows(length=20)),
    ("phimoe sampled routing", "phimoe", dict(router_jitter_noise=0.01, input_jitter_noise=0.01), "eager",
     None, _padded_rows),
    ("opt functional dropout", "opt", dict(dropout=0.1, layerdrop=0.0), "eager", None, _padded_rows),
    ("a left-padded first row", "llama", {}, "eager", None,
     lambda: _padded_rows(rows=2, length=200, pad=150, left=True)),
    ("a user's attention, served exactly", "llama", {}, "user_sdpa", None, _padded_rows),
]


def _correct_cases(rank: int, world: int) -> list[str]:
    from tiny_models import make_tiny

    import lightseq_hf

    failures = []
    _register_attention("user_sdpa", 1.0)
    for name, model_type, overrides, attention, prepare, batch in CORRECT:
        model = make_tiny(model_type, attn=attention, **overrides)
        if prepare is not None:
            prepare(model)
        lightseq_hf.patch(model).train()
        if model_type == "opt":
            model.gradient_checkpointing_enable()
        try:
            report = _check(model, batch())
            if report["sp_size"] != world or report["reference_attention"] != attention:
                failures.append(f"{name}: report {report}")
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            lightseq_hf.unpatch()
    return failures


def _without_softcap(original):
    return lambda *args, **kwargs: original(*args, **{k: v for k, v in kwargs.items() if k != "softcap"})


def _scaled_loss(original):
    return lambda *args, **kwargs: original(*args, **kwargs) * 1.001


def _summing_sync(model) -> None:
    import torch.distributed as dist

    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def _opt_left_padding_is_off(batch: dict) -> bool:
    """Whether the patched OPT differs from the unpatched one on ``batch`` (measured here, not by the
    guard): loss or gradients 1e-4 apart."""
    from tiny_models import loss_and_grads, make_tiny

    import lightseq_hf

    loss, grads, _ = loss_and_grads(make_tiny("opt"), **batch)
    patched = lightseq_hf.patch(make_tiny("opt"))
    loss_p, grads_p, _ = loss_and_grads(patched, **batch)
    lightseq_hf.sync_gradients(patched)
    grads_p = {n: p.grad for n, p in patched.named_parameters() if p.grad is not None}
    lightseq_hf.unpatch()
    if abs(float(loss_p) - float(loss)) > 1e-4 * abs(float(loss)):
        return True
    return any(float((grads_p[n] - g).norm()) > 1e-4 * float(g.norm()) + 1e-9 for n, g in grads.items())


def _wrong_cases(rank: int, world: int) -> list[str]:
    """Each wrong run fails with its words and the worst parameter's layer in one line, on every rank."""
    import test_parity
    from tiny_models import make_tiny

    import lightseq_hf
    from lightseq_hf.parallel import init_sequence_parallel

    failures = []
    left = _padded_rows(rows=2, length=14, pad=4, left=True)
    _register_attention("user_hot", 1.5)
    wrong = [  # (name, type, overrides, attention, batch, sync, planted fault, words, prepare the model)
        ("soft-capping dropped by the patch", "gemma2", dict(attn_logit_softcapping=2.0), "eager",
         _padded_rows(), None, ("dist_flash_attn", _without_softcap), "differs from the unpatched model's",
         _large_scores),
        ("the patch's loss 0.1% off", "llama", {}, "eager", _padded_rows(), None,
         ("sequence_parallel_loss", _scaled_loss), "the loss differs from the unpatched model's", None),
        ("a user's attention replaced", "llama", {}, "user_hot", _padded_rows(), None, None,
         "differs from the unpatched model's (attention 'user_hot')", None),
        ("a summing gradient sync", "llama", {}, "eager", _padded_rows(), _summing_sync, None,
         f"the gradients are {world}.00x the unsharded ones", None),
    ]
    if _opt_left_padding_is_off(left):
        wrong.append(("OPT left padding", "opt", {}, "eager", left, None, None,
                      "differs from the unpatched model's", None))
    for name, model_type, overrides, attention, batch, sync, fault, words, prepare in wrong:
        model = make_tiny(model_type, attn=attention, **overrides)
        if prepare is not None:
            prepare(model)
        model = lightseq_hf.patch(model).train()
        undo = test_parity._replace(*fault) if fault else (lambda: None)
        try:
            _check(model, batch, **({"sync": sync} if sync else {}))
            failures.append(f"{name}: not caught")
        except lightseq_hf.ParityError as err:
            text = str(err)
            if words not in text or "(layer " not in text or "\n" in text:
                failures.append(f"{name}: message {text!r} lacks {words!r} or the layer")
        finally:
            undo()
            lightseq_hf.unpatch()
    init_sequence_parallel(1)  # every rank alone (data parallelism only): nothing split, nothing to compare
    model = lightseq_hf.patch(make_tiny("llama")).train()
    report = _check(model, _padded_rows())
    expected = ("nothing to compare: every rank's sequence-parallel group has 1 rank under a launch of "
                f"{world} processes")
    if report.get("compared") is not False or "passed" in report or expected not in report.get("note", ""):
        failures.append(f"sp_size 1: {report}")
    lightseq_hf.unpatch()
    return failures


def _cases_worker(rank: int, world: int) -> list[str]:
    import logging

    logging.getLogger("lightseq_hf").setLevel(logging.ERROR)
    return _correct_cases(rank, world) + _wrong_cases(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_correct_runs_pass_and_wrong_runs_fail(world):
    failures = [f for result in run_distributed(_cases_worker, world) for f in result]
    assert not failures, "\n".join(failures)


def _data_parallel_worker(rank: int, world: int) -> list[str]:
    """2 data-parallel x 2 sequence-parallel ranks, each data-parallel group its own rows: DDP's average
    over all ranks passes; a sync over the sequence-parallel group only (the data-parallel replicas then
    drift apart) fails."""
    import logging

    from tiny_models import make_tiny

    import lightseq_hf

    logging.getLogger("lightseq_hf").setLevel(logging.ERROR)
    groups = lightseq_hf.init_sequence_parallel(2)
    batch = _padded_rows(seed=10 + groups.dp_rank)
    failures = []
    model = lightseq_hf.patch(make_tiny("llama")).train()
    report = _check(torch.nn.parallel.DistributedDataParallel(model), batch, sync=None)
    if report["gradient_sync"] != "ddp" or report["sp_size"] != 2:
        failures.append(f"rank {rank}: DDP report {report}")
    try:
        _check(model, batch, sync=lambda m: lightseq_hf.sync_gradients(m, group=groups.sp_group))
        failures.append(f"rank {rank}: a sync over the sequence-parallel group only was not caught")
    except lightseq_hf.ParityError as err:
        if "differs from the unpatched model's" not in str(err):
            failures.append(f"rank {rank}: {err}")
    lightseq_hf.unpatch()
    return failures


def test_data_parallel_groups_compare_with_the_mean_over_all_ranks():
    failures = [f for result in run_distributed(_data_parallel_worker, 4) for f in result]
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- the Trainer, the fine-tune


class _LeftPadded(torch.utils.data.Dataset):
    """Rows of 120 tokens left-padded by 1 to 90 tokens (the first sample by 90: the check's prefix of it
    starts at its first real token)."""

    def __init__(self):
        self.ids = torch.randint(3, 128, (8, 120), generator=torch.Generator().manual_seed(7))
        self.pad = [90, 5, 30, 9, 0, 2, 70, 1]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        pad = self.pad[i]
        ids, mask = self.ids[i].clone(), torch.ones(120, dtype=torch.long)
        ids[:pad], mask[:pad] = 0, 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[pad] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _trainer_worker(rank: int, world: int) -> list[str]:
    import contextlib
    import io
    import logging

    from tiny_models import make_model
    from transformers import Trainer, TrainingArguments

    import lightseq_hf

    logging.getLogger("lightseq_hf").setLevel(logging.ERROR)
    lightseq_hf.patch()
    callback = lightseq_hf.ParityCallback()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=1,
                                 save_strategy="no", per_device_train_batch_size=2, disable_tqdm=True,
                                 gradient_checkpointing=True)
        trainer = Trainer(model=make_model("llama"), args=args, train_dataset=_LeftPadded(),
                          callbacks=[callback])
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                trainer.train()
        except SystemExit as stop:
            return [f"rank {rank}: SystemExit({stop.code}): {callback.report}"]
        finally:
            lightseq_hf.unpatch()
    report = callback.report
    if not (report["passed"] and report["padding_tokens"] > 0 and trainer.state.global_step == 1):
        return [f"rank {rank}: {report}, step {trainer.state.global_step}"]
    passes = printed.getvalue().count("lightseq_hf parity check passed on ")
    if passes != (1 if rank == 0 else 0):  # the pass is printed once, by rank 0
        return [f"rank {rank} printed the pass {passes} times: {printed.getvalue()!r}"]
    return []


def test_trainer_with_parity_callback_on_left_padding():
    failures = [f for result in run_distributed(_trainer_worker, 2) for f in result]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_gemma2_fine_tune_passes_its_first_step(tmp_path):
    """Soft-capped attention (cap 2.0) through ``lightseq-finetune --nproc 2``, parity on by default."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    command = [sys.executable, "scripts/finetune.py", "--nproc", "2", "configs/tiny.yaml",
               f"output_dir={tmp_path / 'run'}", "context_length=256", "model.config.model_type=gemma2",
               "model.config.max_position_embeddings=256", "model.config.sliding_window=64",
               "model.config.attn_logit_softcapping=2.0", "training.max_steps=1", "training.warmup_steps=0",
               "training.device=cpu", "logging.progress_bar=false", "data.synthetic.eval_samples=2"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["parity_passed"] and summary["parity_sp_size"] == 2, summary
    assert summary["parity_reference_attention"] in ("eager", "sdpa"), summary  # the model's own


# ----------------------------------------------------------------------------- an unsplit launch


def test_unsplit_launch_is_refused(monkeypatch):
    """``WORLD_SIZE=2`` and no process group (a launcher's processes that never joined one): one line
    naming the call, from every entry point that would otherwise run whole sequences on each process."""
    import torch.distributed as dist
    from tiny_models import make_tiny

    import lightseq_hf

    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    fix = r"WORLD_SIZE=2 .* no process group.* call torch\.distributed\.init_process_group\(\) first"
    with pytest.raises(RuntimeError, match="lightseq_hf.patch\\(model\\): " + fix):
        lightseq_hf.patch(make_tiny("llama"))
    with pytest.raises(RuntimeError, match="init_sequence_parallel: " + fix):
        lightseq_hf.init_sequence_parallel()
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="lightseq_hf.dist_flash_attn: " + fix):
        lightseq_hf.dist_flash_attn(q, q, q)
    lightseq_hf.patch()  # the classes: the Trainer creates the process group before the first forward
    try:
        model = make_tiny("llama")
        with pytest.raises(RuntimeError, match="a model patched by lightseq_hf: " + fix):
            model(**_padded_rows())
        with pytest.raises(RuntimeError, match=fix) as refused:
            lightseq_hf.check_parity(model, _padded_rows())
        assert "\n" not in str(refused.value)
    finally:
        lightseq_hf.unpatch()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a launch of one process splits nothing and needs no group
    model = lightseq_hf.patch(make_tiny("llama"))
    assert model(**_padded_rows()).loss.isfinite()
    lightseq_hf.unpatch()
