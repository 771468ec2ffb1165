"""Hooks users put on the output head, the decoder stack and its final norm, and NEFTune, on 2 and 3 gloo
processes against the unpatched model with the same hook (computed in each worker before the patch).

Each hook case asserts the loss (relative error <= 1e-5, a distillation term of the user's included), every
parameter's gradient after the data-parallel average (<= 1e-4), the shapes the hook saw (the unpatched
model's: the whole sequence, as often), that the first decoder layer still ran on this rank's slice
(ceil(N / P) tokens), and the evaluation logits with the hook, of the whole sequence and of this rank's
slice. Hooks go on before the patch (then with remat checkpointing) in every other case, after it in the
rest. NEFTune: with the same random seed the noisy embeddings are the unpatched model's bit for bit, and so
are the loss and gradients; the noise stays within alpha / sqrt(N d) of the whole row and reaches it; the
Trainer with ``neftune_noise_alpha`` gives one unpatched process's per-step losses and grad norms (<= 1e-6).
One group per world size runs every case."""

from __future__ import annotations

import math

import pytest
import torch
from distributed import rel_err, run_distributed

BATCH, LENGTH, LAYERS, VOCAB, HIDDEN = 2, 29, 2, 128, 64
NEFTUNE_ALPHA = 5.0


def _vector(seed):
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))


def _teacher_logits():
    return 2 * torch.randn(BATCH, LENGTH, VOCAB, generator=torch.Generator().manual_seed(99))


# ----------------------------------------------------------------------------- the hooks
# Each installer registers its hooks on a model and records in ``record["shapes"]`` what they saw.


def head_temperature(model, record):
    def hook(module, args, output):
        record["shapes"].append(tuple(output.shape))
        return output * 0.5

    return [model.lm_head.register_forward_hook(hook)]


def head_pre_hook(model, record):
    steer = _vector(1)

    def hook(module, args):
        record["shapes"].append(tuple(args[0].shape))
        return (args[0] * 1.5 + steer,)

    return [model.lm_head.register_forward_pre_hook(hook)]


def head_distillation(model, record):
    def hook(module, args, output):
        record["shapes"].append(tuple(output.shape))
        record["logits"] = output

    return [model.lm_head.register_forward_hook(hook)]


def distillation_loss(record):
    """A KL term against fixed teacher logits, from the logits the head's hook captured."""
    student = torch.log_softmax(record["logits"] / 2.0, dim=-1)
    teacher = torch.log_softmax(_teacher_logits() / 2.0, dim=-1)
    return torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")


def base_steer_every_token(model, record):
    steer = _vector(2)

    def hook(module, args, output):
        record["shapes"].append(tuple(output.last_hidden_state.shape))
        output.last_hidden_state = output.last_hidden_state + steer
        return output

    return [model.model.register_forward_hook(hook)]


def base_steer_last_token(model, record):
    steer = _vector(3)

    def hook(module, args, output):
        hidden = output.last_hidden_state
        record["shapes"].append(tuple(hidden.shape))
        output.last_hidden_state = torch.cat([hidden[:, :-1], hidden[:, -1:] + steer], dim=1)
        return output

    return [model.model.register_forward_hook(hook)]


def base_pre_hook_remaps_tokens(model, record):
    def hook(module, args, kwargs):
        ids = kwargs["input_ids"]
        record["shapes"].append(tuple(ids.shape))
        return args, {**kwargs, "input_ids": (ids * 5 + 3) % VOCAB}

    return [model.model.register_forward_pre_hook(hook, with_kwargs=True)]


def norm_steer(model, record):
    steer = _vector(4)

    def hook(module, args, output):
        record["shapes"].append(tuple(output.shape))
        return output + steer

    return [model.model.norm.register_forward_hook(hook)]


def norm_pre_hook_ramp(model, record):
    steer = _vector(5)

    def hook(module, args):
        rows = args[0]
        record["shapes"].append(tuple(rows.shape))
        ramp = torch.arange(rows.shape[1], dtype=rows.dtype) / rows.shape[1]
        return (rows + ramp[None, :, None] * steer,)

    return [model.model.norm.register_forward_pre_hook(hook)]


def norm_minus_sequence_mean(model, record):
    def hook(module, args, output):
        record["shapes"].append(tuple(output.shape))
        return output - output.mean(dim=1, keepdim=True)

    return [model.model.norm.register_forward_hook(hook)]


#: name -> (installer, the user's extra loss term or None)
HOOKS = {
    "lm_head forward hook: logits * 0.5": (head_temperature, None),
    "lm_head pre-hook: rows * 1.5 + v": (head_pre_hook, None),
    "lm_head forward hook: distillation from the captured logits": (head_distillation, distillation_loss),
    "model forward hook: steer every token": (base_steer_every_token, None),
    "model forward hook: steer the last token": (base_steer_last_token, None),
    "model pre-hook (kwargs): token ids remapped": (base_pre_hook_remaps_tokens, None),
    "model.norm forward hook: steer every token": (norm_steer, None),
    "model.norm pre-hook: a ramp along the positions": (norm_pre_hook_ramp, None),
    "model.norm forward hook: minus the sequence mean": (norm_minus_sequence_mean, None),
}


# ----------------------------------------------------------------------------- one run of a case


def _layer_lengths(model, lengths):
    return model.model.layers[0].register_forward_pre_hook(lambda m, args: lengths.append(args[0].shape[1]))


def _train_and_eval(model, ids, labels, extra, record):
    """Loss (the model's, plus ``extra``), gradients, and the evaluation logits of the whole sequence."""
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    if extra is not None:
        loss = loss + extra(record)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return loss.detach(), grads, logits


def _reference(name, ids, labels):
    from tiny_models import make_model

    install, extra = HOOKS[name]
    model = make_model("llama", layers=LAYERS, seed=5)
    record, lengths = {"shapes": []}, []
    install(model, record)
    _layer_lengths(model, lengths)
    loss, grads, logits = _train_and_eval(model, ids, labels, extra, record)
    return loss, grads, logits, record["shapes"], lengths


def _average(grads, world):
    import torch.distributed as dist

    for g in grads.values():
        dist.all_reduce(g)
        g /= world
    return grads


def _patched_case(index, name, ids, labels, ref, rank, world):
    from tiny_models import make_model

    import lightseq_hf
    from lightseq_hf.parallel.sharding import shard_for

    install, extra = HOOKS[name]
    ref_loss, ref_grads, ref_logits, ref_shapes, ref_lengths = ref
    model = make_model("llama", layers=LAYERS, seed=5)
    record, lengths = {"shapes": []}, []
    if index % 2:  # hooks on a model that is then patched (with checkpointing), and hooks on a patched model
        install(model, record)
        lightseq_hf.patch_model(model)
        model.activation_checkpointing_enable()
    else:
        lightseq_hf.patch_model(model)
        install(model, record)
    _layer_lengths(model, lengths)
    loss, grads, logits = _train_and_eval(model, ids, labels, extra, record)
    grads = _average(grads, world)
    failures = []
    if rel_err(loss, ref_loss) > 1e-5:
        failures.append(f"{name}: loss {loss.item():.6f} vs unpatched {ref_loss.item():.6f}")
    worst = max((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads)
    if set(grads) != set(ref_grads) or worst[0] > 1e-4:
        failures.append(f"{name}: gradient of {worst[1]} rel err {worst[0]:.2e}")
    if record["shapes"] != ref_shapes:
        failures.append(f"{name}: the hook saw {record['shapes']}, unpatched {ref_shapes}")
    shard = shard_for(LENGTH, rank, world)
    if lengths != [shard.local_len] * len(ref_lengths):
        failures.append(f"{name}: the first layer ran on {lengths} tokens, want {shard.local_len} per call")
    if logits.shape != ref_logits.shape or rel_err(logits, ref_logits) > 1e-5:
        failures.append(f"{name}: evaluation logits {tuple(logits.shape)} differ from the unpatched ones")
    with torch.no_grad():
        local = model(input_ids=ids, lightseq_logits="shard").logits
    want = ref_logits[:, shard.start:shard.real_end]
    if local.shape != want.shape or rel_err(local, want) > 1e-5:
        failures.append(f"{name}: lightseq_logits='shard' logits {tuple(local.shape)} are not the unpatched "
                        f"slice {tuple(want.shape)}")
    return [f"{world} ranks, rank {rank}: {f}" for f in failures]


# ----------------------------------------------------------------------------- NEFTune


def _neftune_run(model, ids, labels):
    """Transformers' NEFTune hook (as the Trainer installs it) with a fixed seed: the loss, gradients, the
    noisy embeddings and the first layer's token counts."""
    from tiny_models import loss_and_grads
    from transformers.integrations.neftune import activate_neftune

    activate_neftune(model, NEFTUNE_ALPHA)
    embedded, lengths = [], []
    embedding = model.get_input_embeddings()
    embedding.register_forward_hook(lambda m, a, out: embedded.append(out.detach().clone()))
    _layer_lengths(model, lengths)
    torch.manual_seed(1234)
    loss, grads, _ = loss_and_grads(model, input_ids=ids, labels=labels)
    return loss, grads, embedded, lengths


def _neftune_case(ids, labels, ref, rank, world):
    from tiny_models import make_model

    import lightseq_hf
    from lightseq_hf.parallel.sharding import shard_for

    ref_loss, ref_grads, ref_embedded, _ = ref
    model = lightseq_hf.patch_model(make_model("llama", layers=LAYERS, seed=6))
    model.activation_checkpointing_enable()
    loss, grads, embedded, lengths = _neftune_run(model, ids, labels)
    grads = _average(grads, world)
    failures = []
    if len(embedded) != 1 or not torch.equal(embedded[0], ref_embedded[0]):
        seen, want = [tuple(e.shape) for e in embedded], tuple(ref_embedded[0].shape)
        failures.append(f"NEFTune: noisy embeddings {seen} are not the unpatched draw {want}")
    noise = ref_embedded[0] - model.get_input_embeddings().weight.detach()[ids]
    bound = NEFTUNE_ALPHA / math.sqrt(LENGTH * HIDDEN)  # the paper's alpha / sqrt(L d), L of the whole row
    largest = noise.abs().max().item()
    if not 0.95 * bound <= largest <= bound * (1 + 1e-6):
        failures.append(f"NEFTune: the unpatched noise reaches {largest:.3e}, bound {bound:.3e}")
    if rel_err(loss, ref_loss) > 1e-5:
        failures.append(f"NEFTune: loss {loss.item():.6f} vs unpatched {ref_loss.item():.6f}")
    worst = max((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads)
    if worst[0] > 1e-4:
        failures.append(f"NEFTune: gradient of {worst[1]} rel err {worst[0]:.2e}")
    if lengths != [shard_for(LENGTH, rank, world).local_len]:
        failures.append(f"NEFTune: the first layer ran on {lengths} tokens")
    return [f"{world} ranks, rank {rank}: {f}" for f in failures]


class _Rows(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.rows = [torch.randint(2, VOCAB, (LENGTH,), generator=g) for _ in range(6)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def trainer_neftune(rank, world):
    """Trainer(neftune_noise_alpha=...) for 3 steps: per-step losses and grad norms, and the first layer's
    token counts (patched when the caller patched)."""
    import tempfile

    from tiny_models import make_model
    from transformers import Trainer, TrainingArguments

    model, lengths = make_model("llama", layers=LAYERS, seed=3), []
    _layer_lengths(model, lengths)
    with tempfile.TemporaryDirectory() as out_dir:
        args = TrainingArguments(output_dir=out_dir, use_cpu=True, report_to=[], max_steps=3, logging_steps=1,
                                 per_device_train_batch_size=BATCH, learning_rate=1e-3, save_strategy="no",
                                 seed=0, disable_tqdm=True, dataloader_num_workers=0,
                                 neftune_noise_alpha=NEFTUNE_ALPHA)
        trainer = Trainer(model=model, args=args, train_dataset=_Rows())
        trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    return [r["loss"] for r in logs] + [r["grad_norm"] for r in logs], lengths


def _trainer_case(reference, rank, world):
    from lightseq_hf.parallel.sharding import shard_for

    values, lengths = trainer_neftune(rank, world)
    failures = []
    if len(values) != len(reference[0]) or rel_err(torch.tensor(values), torch.tensor(reference[0])) > 1e-6:
        failures.append(f"Trainer with NEFTune: losses and grad norms {values}, one process {reference[0]}")
    local = shard_for(LENGTH, rank, world).local_len
    if len(lengths) != len(reference[1]) or set(lengths) != {local}:
        failures.append(f"Trainer with NEFTune: the first layer ran on {lengths} tokens, want {local} a call")
    return [f"{world} ranks, rank {rank}: {f}" for f in failures]


# ----------------------------------------------------------------------------- the group


def worker(rank, world, trainer_reference):
    import logging

    from tiny_models import make_batch, make_model

    import lightseq_hf

    logging.getLogger("lightseq_hf").setLevel(logging.ERROR)
    ids, labels = make_batch(BATCH, LENGTH, seed=21, ignore_prefix=3)
    refs = {name: _reference(name, ids, labels) for name in HOOKS}  # unpatched, the whole sequence
    neftune_ref = _neftune_run(make_model("llama", layers=LAYERS, seed=6), ids, labels)
    lightseq_hf.patch()
    failures = []
    try:
        for index, name in enumerate(HOOKS):
            failures += _patched_case(index, name, ids, labels, refs[name], rank, world)
        failures += _neftune_case(ids, labels, neftune_ref, rank, world)
        failures += _trainer_case(trainer_reference, rank, world)
    finally:
        lightseq_hf.unpatch()
    return failures


@pytest.fixture(scope="module")
def trainer_reference():
    """The Trainer with NEFTune on one unpatched process (its own, so that no data parallelism starts)."""
    return run_distributed(trainer_neftune, 1)[0]


@pytest.mark.parametrize("world", [2, 3])
def test_user_hooks_match_the_unpatched_model(world, trainer_reference):
    results = run_distributed(worker, world, trainer_reference)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures)


def test_the_unfused_path_is_logged_once_naming_the_hooked_modules(caplog):
    """One process: the notice names the hooked modules once, the loss is the unpatched model's with the
    hooks, and once they are removed, the unpatched model's without them."""
    import logging

    from tiny_models import loss_and_grads, make_batch, make_model

    import lightseq_hf

    ids, labels = make_batch(BATCH, LENGTH, seed=4)
    plain = loss_and_grads(make_model("llama", layers=LAYERS), input_ids=ids, labels=labels)[0]
    hooked = make_model("llama", layers=LAYERS)
    head_temperature(hooked, {"shapes": []}), norm_steer(hooked, {"shapes": []})
    want = loss_and_grads(hooked, input_ids=ids, labels=labels)[0]
    try:
        model = lightseq_hf.patch_model(make_model("llama", layers=LAYERS))
        handles = head_temperature(model, {"shapes": []}) + norm_steer(model, {"shapes": []})
        with caplog.at_level(logging.WARNING, logger="lightseq_hf"):
            losses = [loss_and_grads(model, input_ids=ids, labels=labels)[0] for _ in range(2)]
        notices = [r.getMessage() for r in caplog.records if "forward hooks on" in r.getMessage()]
        assert len(notices) == 1 and "forward hooks on lm_head, model.norm:" in notices[0], notices
        assert all(rel_err(loss, want) <= 1e-6 for loss in losses)
        for handle in handles:
            handle.remove()
        assert rel_err(loss_and_grads(model, input_ids=ids, labels=labels)[0], plain) <= 1e-6
    finally:
        lightseq_hf.unpatch()
