"""lightseq_hf.check_parity on 2 and 3 gloo processes (one spawned group per world size).

* Correct setups pass (plain, packed by position_ids and by cu_seq_lens, left and right padding, a
  sliding window, GQA, DDP, remat and HF checkpointing, checkpoint offload and tiled MLPs, a prefix of
  a longer batch), and leave parameters, gradients, buffers and the torch/Python/NumPy RNG states
  bit-identical.
* Planted faults fail with their message on every rank: a wrong shard order, a dropped document mask,
  a kernel whose output is off by 1e-4 (relative), a loop without gradient sync, a rank whose attention
  would run unsharded, sequence parallelism silently off (a use_cache=True call).
* No false alarm in 100 consecutive checks of random correct setups (2 processes, fp32, rtol 1e-5);
  under bfloat16 autocast (3 processes) correct setups pass at the default tolerance and a reversed
  shard order still fails.
* ParityCallback under a Trainer and TRL's SFTTrainer (padding_free) on 2 processes: passes, and stops a
  faulty run before its first step.
"""

from __future__ import annotations

import random
import sys

import numpy
import pytest
import torch
from distributed import run_distributed

#: (name, model overrides, batch kind, patch options, checkpointing, wrap, rows, length, max_tokens)
CORRECT = [
    ("plain", {}, "plain", {}, None, "sync", 2, 23, None),
    ("packed, DDP, remat", {}, "packed", {}, "remat", "ddp", 2, 29, None),
    ("padded, hf checkpointing", {}, "padded", {"checkpointing": "hf"}, "hf", "sync", 2, 26, None),
    ("cu_seq_lens", {}, "cu", {}, None, "sync", 1, 31, None),
    ("window, packed, offload, tiled MLP", {"arch": "mistral", "sliding_window": 6}, "packed",
     {"offload_checkpoints": True, "tiled_mlp": 7}, "remat", "sync", 2, 27, None),
    ("prefix of a longer batch", {}, "packed", {}, None, "ddp", 3, 60, 64),
]


def _batch(kind: str, rows: int, length: int, seed: int) -> dict:
    from tiny_models import make_batch

    ids, labels = make_batch(rows, length, seed)
    batch = {"input_ids": ids, "labels": labels}
    gen = random.Random(seed)
    if kind == "packed":
        pos = []
        for _ in range(rows):
            cuts = sorted(gen.sample(range(2, length - 1), 2))
            pos.append(torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, length])]))
        batch["position_ids"] = torch.stack(pos)
    elif kind == "padded":  # row 0 right-padded, the others left-padded; no padding label is predicted
        mask = torch.ones(rows, length, dtype=torch.long)
        pad = gen.randint(3, length // 2)
        mask[0, length - pad:] = 0
        labels[0, length - pad:] = -100
        for r in range(1, rows):
            mask[r, :pad] = 0
            labels[r, :pad + 1] = -100
        batch["attention_mask"] = mask
    elif kind == "cu":
        a, b = sorted(gen.sample(range(2, length - 3), 2))
        cu = torch.tensor([0, a, b, length - 2], dtype=torch.int32)  # the last 2 tokens: padding
        labels[:, length - 3:] = -100
        batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=int(cu.diff().max()),
                     max_length_k=int(cu.diff().max()))
    return batch


def _model(overrides: dict, patch: dict, checkpointing: str | None, seed: int = 0):
    from tiny_models import make_model

    import lightseq_hf

    overrides = dict(overrides)
    model = make_model(overrides.pop("arch", "llama"), seed=seed, **overrides)
    lightseq_hf.patch_model(model, **patch)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model


def _snapshot(model) -> dict:
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else (p.grad, p.grad.detach().clone()) for p in model.parameters()],
        "rng": (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy()),
    }


def _unchanged(model, before: dict) -> list[str]:
    problems = []
    if not all(torch.equal(a, p) for a, p in zip(before["params"], model.parameters())):
        problems.append("parameters changed")
    for saved, p in zip(before["grads"], model.parameters()):
        if saved is None and p.grad is not None or saved is not None and (
                p.grad is not saved[0] or not torch.equal(p.grad, saved[1])):
            problems.append("gradients changed")
            break
    cpu, py, np_state = before["rng"]
    if not (torch.equal(cpu, torch.get_rng_state()) and py == random.getstate()
            and numpy.array_equal(np_state, numpy.random.get_state()[1])):
        problems.append("RNG state changed")
    return problems


def _correct_cases(rank: int, world: int) -> list[str]:
    import lightseq_hf

    failures = []
    for name, overrides, kind, patch, ckpt, wrap, rows, length, max_tokens in CORRECT:
        model = _model(overrides, patch, ckpt)
        for i, p in enumerate(model.parameters()):  # gradients left from earlier steps must survive
            p.grad = torch.randn_like(p) if i % 2 else None
        torch.manual_seed(1234)
        before = _snapshot(model)
        checked = torch.nn.parallel.DistributedDataParallel(model) if wrap == "ddp" else model
        try:
            report = lightseq_hf.check_parity(checked, _batch(kind, rows, length, seed=5),
                                              max_tokens=max_tokens,
                                              sync=lightseq_hf.sync_gradients if wrap == "sync" else None)
        except lightseq_hf.ParityError as err:
            failures.append(f"{name}: {err}")
            continue
        failures += [f"{name}: {p}" for p in _unchanged(model, before)]
        expect_tokens = min(rows * length, max_tokens or rows * length)
        if report["tokens"] > expect_tokens or report["sp_size"] != world or report["attention_layers"] != 2:
            failures.append(f"{name}: report {report}")
        if max_tokens is None and kind in ("packed", "cu") and report["documents"] < 2 * report["rows"] or \
                kind == "padded" and report["padding_tokens"] == 0:
            failures.append(f"{name}: masks not exercised: {report}")
        if "sliding_window" in overrides and not report["window_exercised"]:
            failures.append(f"{name}: window not exercised: {report}")
        if report["gradient_sync"] != {"ddp": "ddp", "sync": "sync_gradients"}[wrap]:
            failures.append(f"{name}: gradient sync reported as {report['gradient_sync']}")
    return failures


def _replace(name: str, make):
    """Replace ``name`` in every lightseq_hf module that imported it; returns the undo."""
    owners = [m for key, m in list(sys.modules.items()) if key.startswith("lightseq_hf") and hasattr(m, name)]
    original = getattr(owners[0], name)
    replacement = make(original)
    for module in owners:
        if getattr(module, name) is original:
            setattr(module, name, replacement)
    return lambda: [setattr(m, name, original) for m in owners if getattr(m, name) is replacement]


def _reversed_shards(original):
    return lambda seq_len, rank, world: original(seq_len, world - 1 - rank, world)


def _without_documents(original):
    return lambda *args, **kwargs: original(*args, **{**kwargs, "segments": None})


def _kernel_off_by(relative: float, on_rank: int):
    import torch.distributed as dist

    class Off:
        def __init__(self, kernel):
            self._kernel = kernel

        def __getattr__(self, attr):
            return getattr(self._kernel, attr)

        def forward(self, *args, **kwargs):
            out, lse = self._kernel.forward(*args, **kwargs)
            if dist.get_rank() == on_rank:
                out = out.mul_(1 + relative) if kwargs.get("out") is not None else out * (1 + relative)
            return out, lse

    return lambda original: (lambda *args, **kwargs: Off(original(*args, **kwargs)))


def _fault_cases(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    import lightseq_hf

    failures = []
    solo = dist.new_group([rank], use_local_synchronization=True)
    faults = [  # (name, what to replace, replacement, batch kind, patch options, sync, expected message)
        ("wrong shard order", "shard_for", _reversed_shards, "plain", {}, True,
         "differs from the unpatched model"),
        ("dropped document mask", "dist_flash_attn", _without_documents, "packed", {}, True,
         "differs from the unpatched model"),
        ("kernel off by 1e-4", "kernel_named", _kernel_off_by(1e-4, on_rank=world - 1), "plain", {}, True,
         "differs from the unpatched model"),
        ("missing gradient sync", None, None, "plain", {}, False, "nothing averages them"),
        ("a rank runs unsharded", None, None, "plain", {"sp_group": solo} if rank == 1 else {}, True,
         "rank 1 would run its attention unsharded"),
        ("sequence parallelism off", None, None, "use_cache", {}, True, "sequence parallelism is off"),
    ]
    for name, target, make, kind, patch, sync, message in faults:
        model = _model({}, patch, None if kind == "use_cache" else "remat")
        before = _snapshot(model)
        undo = _replace(target, make) if target else (lambda: None)
        batch = _batch("plain" if kind == "use_cache" else kind, 2, 24, seed=9)
        if kind == "use_cache":
            batch["use_cache"] = True
        try:
            lightseq_hf.check_parity(model, batch, sync=lightseq_hf.sync_gradients if sync else None)
            failures.append(f"{name}: not caught")
        except lightseq_hf.ParityError as err:
            text = str(err)
            if message not in text or "\n" in text or not text.startswith("lightseq_hf parity check failed"):
                failures.append(f"{name}: message {text!r} lacks {message!r}")
        finally:
            undo()
        failures += [f"{name}: {p}" for p in _unchanged(model, before)]
    return failures


def _no_false_alarm(rank: int, world: int, checks: int) -> tuple[list[str], float]:
    """``checks`` random correct setups at fp32 with rtol 1e-5; returns failures and the worst error."""
    import lightseq_hf

    failures, worst = [], 0.0
    model = _model({"arch": "mistral", "sliding_window": 5, "layers": 1}, {}, None, seed=1)
    gen = random.Random(11)
    for i in range(checks):
        kind = ("plain", "packed", "padded", "cu")[i % 4]
        rows, length = (1 if kind == "cu" else gen.randint(1, 2)), gen.randint(12, 36)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2, generator=torch.Generator().manual_seed(i))
        try:
            report = lightseq_hf.check_parity(model, _batch(kind, rows, length, seed=100 + i), rtol=1e-5,
                                              sync=lightseq_hf.sync_gradients, seed=i)
            worst = max(worst, report["loss_rel_err"], report["grad_rel_err"])
        except lightseq_hf.ParityError as err:
            failures.append(f"check {i} ({kind}, {rows} x {length}): {err}")
    return failures, worst


class _Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 128, (8, 21), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _make_trainer(kind: str, out: str, callback):
    from transformers import Trainer, TrainingArguments

    common = dict(output_dir=out, use_cpu=True, report_to=[], max_steps=1, learning_rate=1e-2,
                  per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True,
                  gradient_checkpointing=True)
    if kind == "trainer":
        return Trainer(model=_model({}, {}, None), args=TrainingArguments(**common), train_dataset=_Tokens(),
                       callbacks=[callback])
    from datasets import Dataset
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {f"t{i}": i for i in range(128)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t2")),
                                        pad_token="t0", eos_token="t1", unk_token="t2")
    data = Dataset.from_dict({"input_ids": [list(range(3, 3 + n)) for n in (17, 23, 12, 20)]})
    args = SFTConfig(padding_free=True, max_length=None, **common)
    return SFTTrainer(model=_model({}, {}, None), args=args, train_dataset=data, processing_class=tokenizer,
                      callbacks=[callback])


def _trainer_cases(rank: int, world: int) -> list[str]:
    """ParityCallback under a Trainer (DDP over the group, remat checkpointing) and TRL's SFTTrainer with
    padding_free (packed rows): passes; with the shard order reversed it stops every rank with
    SystemExit(1) before the first optimizer step."""
    import tempfile

    import lightseq_hf

    failures = []
    for kind, fault in (("trainer", False), ("trainer", True), ("trl padding_free", False)):
        callback = lightseq_hf.ParityCallback()
        with tempfile.TemporaryDirectory() as out:
            trainer = _make_trainer(kind, out, callback)
            before = [p.detach().clone() for p in trainer.model.parameters()]
            undo = _replace("shard_for", _reversed_shards) if fault else (lambda: None)
            try:
                trainer.train()
                if fault:
                    failures.append(f"{kind}: the reversed shard order was not caught")
            except SystemExit as stop:
                if not fault or stop.code != 1:
                    failures.append(f"{kind}: SystemExit({stop.code}), fault {fault}: {callback.report}")
            finally:
                undo()
        if fault and not all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters())):
            failures.append(f"{kind}: a step ran before the check stopped it")
        report = callback.report or {}
        if report.get("passed") is not (not fault) or not fault and (
                report.get("gradient_sync") != "sync_gradients" or report.get("sp_size") != world
                or kind.startswith("trl") and report.get("documents", 0) < 2):
            failures.append(f"{kind}: fault {fault}, report {report}")
        if not fault and not any(e.get("parity_passed") for e in trainer.state.log_history):
            failures.append(f"{kind}: no parity entry in log_history {trainer.state.log_history}")
    return failures


def _bf16_cases(rank: int, world: int) -> list[str]:
    """bfloat16 autocast: correct setups pass at the default tolerance; a reversed shard order fails."""
    import lightseq_hf

    failures = []
    model = _model({"arch": "mistral", "sliding_window": 5}, {}, "remat", seed=2)
    for i, kind in enumerate(("plain", "packed", "padded", "cu", "reversed")):
        undo = _replace("shard_for", _reversed_shards) if kind == "reversed" else (lambda: None)
        batch = _batch("plain" if kind == "reversed" else kind, 1 if kind == "cu" else 2, 25 + i, seed=40 + i)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                report = lightseq_hf.check_parity(model, batch, sync=lightseq_hf.sync_gradients)
            if kind == "reversed" or report["dtype"] != "bfloat16" or report["rtol"] != 0.1:
                failures.append(f"bf16 {kind}: {report}")
        except lightseq_hf.ParityError as err:
            if kind != "reversed":
                failures.append(f"bf16 {kind}: {err}")
        finally:
            undo()
    return failures


def _worker(rank: int, world: int, false_alarm_checks: int):
    from lightseq_hf.parallel import init_sequence_parallel

    init_sequence_parallel(world)
    failures = _correct_cases(rank, world) + _fault_cases(rank, world)
    failures += _trainer_cases(rank, world) if world == 2 else _bf16_cases(rank, world)
    more, worst = _no_false_alarm(rank, world, false_alarm_checks)
    return failures + more, worst


@pytest.mark.parametrize("world,checks", [(2, 100), (3, 8)])
def test_parity_check(world, checks):
    results = run_distributed(_worker, world, checks)
    failures = [f for result in results for f in (result[0] if isinstance(result, tuple) else result)]
    assert not failures, "\n".join(failures)
    assert all(result[1] < 1e-5 for result in results)


def test_single_process_and_bad_input():
    """Without torch.distributed the check compares the world-1 kernels with the unpatched model; an
    unpatched model and a batch without tokens are refused with one line; the config section."""
    import transformers

    import lightseq_hf
    from lightseq_hf.guard import run_first_step_check
    from lightseq_hf.guard.first_step import ParityConfig

    model = _model({}, {}, "remat")
    report = lightseq_hf.check_parity(model, _batch("packed", 2, 30, seed=3), max_tokens=40)
    assert report["passed"] and report["tokens"] <= 40 and report["sp_size"] == 1
    off = run_first_step_check(model, _batch("plain", 1, 20, seed=1), {"enabled": False})
    assert off == {"enabled": False}
    assert run_first_step_check(model, _batch("plain", 1, 20, seed=1), {"rtol": 1e-5})["enabled"]
    with pytest.raises(ValueError, match="max_tokens"):
        ParityConfig.model_validate({"max_tokens": 0})
    with pytest.raises(ValueError, match="extra"):
        ParityConfig.model_validate({"tolerance": 1e-3})
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(n_layer=1, hidden_size=16, n_head=2))
    with pytest.raises(ValueError, match="not patched by lightseq_hf"):  # a model the patch refuses
        lightseq_hf.check_parity(bloom, _batch("plain", 1, 20, seed=1))
    with pytest.raises(ValueError, match="needs a batch with input_ids"):
        lightseq_hf.check_parity(model, {"labels": torch.zeros(1, 4, dtype=torch.long)})


def test_a_prefix_without_labels_and_a_nonfinite_loss():
    """A prefix whose labels supervise no token (a prompt-masked sample) is checked with next-token labels
    from input_ids, not as a NaN loss that compares with nothing; a NaN loss fails the check; a prefix of
    embeddings without a supervised label is refused with one line."""
    import math

    import lightseq_hf

    model = _model({}, {}, "remat")
    batch = _batch("padded", 2, 24, seed=4)
    batch["labels"] = torch.full_like(batch["input_ids"], -100)
    report = lightseq_hf.check_parity(model, batch, rtol=1e-5)
    assert report["passed"] and report["labels"] == "input_ids (no label in the prefix)"
    assert math.isfinite(report["loss"]) and report["loss"] == pytest.approx(report["loss_reference"], 1e-5)
    assert lightseq_hf.check_parity(model, _batch("plain", 1, 20, seed=1))["labels"] == "labels"
    weight = model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight[0, 0] = math.nan
    with pytest.raises(lightseq_hf.ParityError, match="the loss is not finite"):
        lightseq_hf.check_parity(model, _batch("plain", 1, 20, seed=1))
    embeds = {"inputs_embeds": torch.randn(1, 20, model.config.hidden_size),
              "labels": torch.full((1, 20), -100)}
    with pytest.raises(ValueError, match="inputs_embeds and no supervised label"):
        lightseq_hf.check_parity(model, embeds)


def test_a_batch_given_as_lists():
    """Per-token entries given as lists (a collator's output) are checked as the tensors they stand for:
    the same report as with tensors; ragged lists are refused in one line naming the entry."""
    import lightseq_hf

    model = _model({}, {}, None)
    batch = _batch("packed", 2, 24, seed=6)
    as_lists = {**batch, "position_ids": batch["position_ids"].tolist(),
                "attention_mask": torch.ones_like(batch["input_ids"]).tolist()}
    mask = torch.ones_like(batch["input_ids"])
    expected = lightseq_hf.check_parity(model, {**batch, "attention_mask": mask}, max_tokens=48)
    report = lightseq_hf.check_parity(model, as_lists, max_tokens=48)
    assert report["passed"] and report["documents"] == expected["documents"] == 6  # 3 packed in each row
    assert report["loss"] == expected["loss"]
    with pytest.raises(ValueError, match=r"entry 'position_ids' is a list that cannot be made a tensor"):
        lightseq_hf.check_parity(model, {**batch, "position_ids": [[0, 1, 2], [0, 1]]})


def test_default_cost_on_the_7b_configs():
    """The default prefix costs under 5% of the first optimizer step's model FLOPs on the GPU configs."""
    import types
    from pathlib import Path

    import yaml

    from lightseq_hf.guard.first_step import check_cost_fraction

    for name, world in (("llama2-7b-32k-2gpu", 2), ("llama2-7b-64k", 8), ("llama3-8b-128k", 8)):
        cfg = yaml.safe_load((Path(__file__).parent.parent / "configs" / f"{name}.yaml").read_text())
        model = types.SimpleNamespace(**cfg["model"]["config"])
        train = cfg["training"]
        fraction = check_cost_fraction(model, cfg["context_length"], cfg.get("sp_size") or world,
                                       train.get("grad_accum", 1), train.get("batch_size", 1))
        assert 0 < fraction < 0.05, (name, fraction)
