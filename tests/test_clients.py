"""The clients people train with, on 2 and 3 gloo processes, against the same script on one unpatched process.

Each client runs a few optimizer steps (or one evaluation) with ``lightseq_hf.patch_llama()`` on P ranks and
without it on one process (a separate spawned process, so nothing of the patch leaks into the reference).
For each client the test asserts

* the split: how many distributed-attention forwards ran and the local query length each layer saw
  (never more than ceil(N / P) of the N tokens of a row);
* per-step loss and grad-norm parity (relative error) with the one-process run, within the bound its
  row of the README's client table states; refused clients raise, at their first step, the message
  that row quotes.

The README table is parsed here: every row names a client this test runs, and every client has a row.
"""

from __future__ import annotations

import collections
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from distributed import rel_err, run_distributed

LAYERS, STEPS, BATCH, LENGTH, MAX_LENGTH, SAMPLES = 2, 3, 2, 29, 26, 12
README = Path(__file__).resolve().parents[1] / "README.md"


# ----------------------------------------------------------------------------- data and models


def _model(seed=3, **overrides):
    from tiny_models import make_model

    return make_model("llama", layers=LAYERS, seed=seed, **overrides)


def _rows(lengths=None, seed=7):
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [LENGTH] * SAMPLES
    return [torch.randint(2, 128, (n,), generator=g).tolist() for n in lengths]


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = [torch.tensor(r) for r in rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(128)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t2")),
                                   pad_token="t0", eos_token="t1", unk_token="t2")


def _args(out_dir, cls=None, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=out_dir, use_cpu=True, report_to=[], max_steps=STEPS, logging_steps=1,
                  per_device_train_batch_size=BATCH, learning_rate=1e-3, save_strategy="no", seed=0,
                  disable_tqdm=True, dataloader_num_workers=0, bf16=False)
    kwargs.update(overrides)
    return (cls or TrainingArguments)(**kwargs)


def _history(trainer):
    logs = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    return [r["loss"] for r in logs], [r["grad_norm"] for r in logs]


# ----------------------------------------------------------------------------- the clients
# Each returns {"losses": [...], "grad_norms": [...], "forwards": k, "max_len": N} where k is how many
# attention forwards a run makes per layer (patched) and N the longest row; or raises.


def client_trainer_label_smoothing(out_dir):
    from transformers import Trainer

    trainer = Trainer(model=_model(), args=_args(out_dir, label_smoothing_factor=0.1),
                      train_dataset=_Tokens(_rows()))
    trainer.train()
    losses, norms = _history(trainer)
    return {"losses": losses, "grad_norms": norms, "forwards": STEPS, "max_len": LENGTH}


def client_trainer_bf16(out_dir):
    from transformers import Trainer

    trainer = Trainer(model=_model(), args=_args(out_dir, bf16=True), train_dataset=_Tokens(_rows()))
    trainer.train()
    losses, norms = _history(trainer)
    return {"losses": losses, "grad_norms": norms, "forwards": STEPS, "max_len": LENGTH}


def client_trainer_evaluate(out_dir):
    """Trainer.evaluate with compute_metrics over whole sequences (5 samples, batches of 2: a remainder)."""
    import numpy as np
    from transformers import Trainer

    seen = {}

    def compute_metrics(pred):
        logits, labels = pred.predictions, pred.label_ids
        seen["shape"] = tuple(logits.shape)
        hits = (logits[:, :-1].argmax(-1) == labels[:, 1:]).astype(np.float64)
        return {"accuracy": float(hits.mean()), "logit_sum": float(np.abs(logits).astype(np.float64).sum())}

    trainer = Trainer(model=_model(), args=_args(out_dir, per_device_eval_batch_size=2),
                      eval_dataset=_Tokens(_rows()[:5]), compute_metrics=compute_metrics)
    metrics = trainer.evaluate()
    if seen["shape"] != (5, LENGTH, 128):
        raise AssertionError(f"compute_metrics saw logits {seen['shape']}, want (5, {LENGTH}, 128)")
    values = [metrics["eval_loss"], metrics["eval_accuracy"], metrics["eval_logit_sum"]]
    return {"losses": values, "grad_norms": [], "forwards": 3, "max_len": LENGTH}


def _sft(out_dir, rows=None, peft_config=None, **config):
    import transformers
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    transformers.set_seed(0)  # LoRA's initial weights
    data = Dataset.from_dict({"input_ids": rows or _rows([20, 29, 24, 27, 22, 29, 26, 21, 28, 25, 23, 29])})
    config = {"max_length": MAX_LENGTH, **config}
    args = _args(out_dir, cls=SFTConfig, gradient_checkpointing=True, **config)
    trainer = SFTTrainer(model=_model(), args=args, train_dataset=data, processing_class=_tokenizer(),
                         peft_config=peft_config)
    trainer.train()
    losses, norms = _history(trainer)
    return {"losses": losses, "grad_norms": norms, "max_len": MAX_LENGTH,
            "forwards": STEPS * (2 if config.get("label_smoothing_factor") else 1)}


def client_trl_sft(out_dir):
    return _sft(out_dir)


def client_trl_sft_dft(out_dir):
    return _sft(out_dir, loss_type="dft")


def client_trl_sft_peft(out_dir):
    from peft import LoraConfig

    return _sft(out_dir, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def client_trl_sft_label_smoothing(out_dir):
    return _sft(out_dir, label_smoothing_factor=0.1)


def client_trl_sft_packing(out_dir):
    return {**_sft(out_dir, packing=True), "max_len": MAX_LENGTH * BATCH}  # a batch becomes one packed row


def client_trl_sft_padding_free(out_dir):
    result = _sft(out_dir, rows=[r[:MAX_LENGTH] for r in _rows()], padding_free=True, max_length=None)
    return {**result, "max_len": MAX_LENGTH * BATCH}  # a batch becomes one packed row


def client_liger(out_dir):
    """Liger-Kernel's Llama patch (fused linear cross-entropy, Triton's CPU interpreter) under a Trainer."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers import Trainer

    import lightseq_hf

    patched = lightseq_hf.patches.state.current_settings() is not None
    lightseq_hf.unpatch_llama()
    apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, fused_linear_cross_entropy=True)
    if patched:
        lightseq_hf.patch_llama()  # after Liger: its forward stays, the split is in LlamaModel
    trainer = Trainer(model=_model(), args=_args(out_dir), train_dataset=_Tokens(_rows()))
    trainer.train()
    from transformers.models.llama import modeling_llama

    if not modeling_llama.LlamaForCausalLM.forward.__module__.startswith("liger_kernel"):
        raise AssertionError("Liger's forward did not run")
    losses, norms = _history(trainer)
    return {"losses": losses, "grad_norms": norms, "forwards": STEPS, "max_len": LENGTH}


def _averaged_grad_norm(model):
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    total = 0.0
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.detach().clone()
            if world > 1:
                dist.all_reduce(g)
                g /= world
            p.grad.copy_(g)
            total += float(g.double().pow(2).sum())
    return math.sqrt(total)


def client_accelerate_loop(out_dir):
    from accelerate import Accelerator

    from lightseq_hf.patches import shard_by_data_parallel_rank

    accelerator = Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_Tokens(_rows()), batch_size=BATCH)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    loader = shard_by_data_parallel_rank(loader)  # the ranks of a group share batches
    losses, norms = [], []
    for _, batch in zip(range(STEPS), loader):
        loss = model(**batch).loss
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "forwards": STEPS, "max_len": LENGTH}


def client_torch_compile(out_dir):
    """torch.compile(model) as the very first call (dynamo tracing with the aot_eager backend)."""
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = _Tokens(_rows())
    losses, norms = [], []
    for step in range(STEPS):
        ids = torch.stack([data[2 * step]["input_ids"], data[2 * step + 1]["input_ids"]])
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(_averaged_grad_norm(model))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms, "forwards": STEPS, "max_len": LENGTH}


def _cache_of(output):
    """The KV cache of a forward's output, under Transformers' current name (``cache`` from 5.24)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def _decode_step(model, ids, previous):
    """One decoding step after ``previous`` (a forward with ``use_cache=True``), passing the cache under the
    name the model's forward takes (``past_key_values`` goes in Transformers 5.40)."""
    from lightseq_hf.patches.forward import cache_keyword

    return model(input_ids=ids, use_cache=True, **{cache_keyword(type(model).forward): _cache_of(previous)})


def client_kv_cache(out_dir):
    """Prefill with use_cache=True, one decode step, and generate(): unsharded on every rank."""
    model = _model()
    model.eval()
    ids = torch.tensor(_rows()[0])[None]
    with torch.no_grad():
        prefill = model(input_ids=ids[:, :-1], use_cache=True)
        step = _decode_step(model, ids[:, -1:], prefill)
        generated = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
    values = [float(prefill.logits.double().abs().sum()), float(step.logits.double().abs().sum()),
              float(generated.double().sum())]
    return {"losses": values, "grad_norms": [], "forwards": 0, "max_len": LENGTH}


def client_output_attentions(out_dir):
    model = _model()
    ids = torch.tensor(_rows()[0])[None]
    out = model(input_ids=ids, output_attentions=True)
    return {"losses": [float(out.logits.sum())], "grad_norms": [], "forwards": 1, "max_len": LENGTH}


CLIENTS = {
    "Trainer, label_smoothing_factor": client_trainer_label_smoothing,
    "Trainer, bf16=True on fp32 weights": client_trainer_bf16,
    "Trainer.evaluate, compute_metrics": client_trainer_evaluate,
    "TRL SFTTrainer, max_length, gradient_checkpointing": client_trl_sft,
    "TRL SFTTrainer, loss_type='dft'": client_trl_sft_dft,
    "TRL SFTTrainer, peft_config (LoRA)": client_trl_sft_peft,
    "TRL SFTTrainer, label_smoothing_factor": client_trl_sft_label_smoothing,
    "TRL SFTTrainer, packing=True": client_trl_sft_packing,
    "TRL SFTTrainer, padding_free=True": client_trl_sft_padding_free,
    "accelerate loop": client_accelerate_loop,
    "torch.compile, first call": client_torch_compile,
    "KV cache: prefill, decode, generate": client_kv_cache,
    "output_attentions=True": client_output_attentions,
    "Liger fused linear cross-entropy": client_liger,  # last: Liger patches the class for good
}


# ----------------------------------------------------------------------------- workers


def check_gather_sequence(rank, world, device):
    """gather_sequence: the whole rows forward, this rank's slice of the group-summed gradient backward."""
    from lightseq_hf.parallel.sharding import gather_sequence, shard_for

    failures = []
    for seq in (12, 11):  # divisible by 2 and 3 or not: right-padded to a multiple of the group
        g = torch.Generator(device=device).manual_seed(seq)
        full = torch.randn(2, seq, 8, device=device, generator=g)
        weight = torch.randn(2, seq, 8, device=device, generator=g)
        shard = shard_for(seq, rank, world)
        padded = torch.nn.functional.pad(full, (0, 0, 0, shard.padded_len - seq))
        local = padded[:, shard.start:shard.end].clone().requires_grad_(True)
        gathered = gather_sequence(local, None, shard)
        (gathered * weight * (rank + 1)).sum().backward()  # a different loss on every rank
        summed = weight * sum(r + 1 for r in range(world))
        want = torch.nn.functional.pad(summed, (0, 0, 0, shard.padded_len - seq))[:, shard.start:shard.end]
        exact = gathered.shape == full.shape and torch.equal(gathered, full)
        if not exact or rel_err(local.grad, want) > 1e-6:
            failures.append(f"gather_sequence, rank {rank}, length {seq}: gathered {tuple(gathered.shape)}, "
                            f"gradient rel err {rel_err(local.grad, want):.1e}")
    return failures



def worker(rank, world, patched):
    with pytest.MonkeyPatch.context() as patches:  # undone when the worker ends, even by an exception
        return run_clients(rank, world, patched, patches)


def run_clients(rank, world, patched, patches):
    patches.setenv("TRITON_INTERPRET", "1")  # Liger's Triton kernels on the CPU
    import logging

    import lightseq_hf
    from lightseq_hf.parallel import ops

    logging.getLogger("lightseq_hf").setLevel(logging.ERROR)
    lengths = collections.Counter()  # local query length of every attention forward the op ran
    schedule_forward = ops.dist_attn_forward

    def recording_forward(q, *args, **kwargs):
        lengths[q.shape[1]] += 1
        return schedule_forward(q, *args, **kwargs)

    patches.setattr(ops, "dist_attn_forward", recording_forward)  # inside the op: what compiled graphs run
    results = {}
    if patched:
        lightseq_hf.patch_llama()
        results["gather_sequence"] = check_gather_sequence(rank, world, torch.device("cpu"))
    only = os.environ.get("LIGHTSEQ_TEST_CLIENTS")  # a substring, to run some clients while debugging
    for name, client in CLIENTS.items():
        if only and only not in name:
            continue
        lengths.clear()
        with tempfile.TemporaryDirectory() as out_dir:
            try:
                result = client(out_dir)
            except Exception as exc:  # noqa: BLE001  (compared with the table, so none passes unseen)
                result = {"error": f"{type(exc).__name__}: {exc}"}
        result["calls"] = sum(lengths.values())
        result["lengths"] = dict(lengths)
        results[name] = result
    return results


def _table():
    """The client table of the README: {client: (status, text of the row's result cell)}."""
    text = README.read_text()
    start = text.index("<!-- clients table -->")
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("client", "---") or set(cells[0]) <= {"-"}:
            continue
        status = cells[1].split()[0]
        rows[cells[0]] = (status, cells[2])
    return rows


@pytest.fixture(scope="module")
def reference():
    return run_distributed(worker, 1, False)[0]


def _compare(name, world, rank, r, ref, bound, failures):
    if "error" in r:
        failures.append(f"{name}, rank {rank}: {r['error']}")
        return
    got, want = r["losses"] + r["grad_norms"], ref["losses"] + ref["grad_norms"]
    if len(got) != len(want) or not want:
        failures.append(f"{name}, rank {rank}: {len(got)} values, want {len(want)}")
        return
    worst = max(rel_err(torch.tensor(g), torch.tensor(w)) for g, w in zip(got, want))
    print(f"[{world} ranks, rank {rank}] {name}: max rel err {worst:.1e} (bound {bound:g}), attention "
          f"forwards {r['calls']}, local lengths {r['lengths']}")
    if worst > bound:
        failures.append(f"{name}, rank {rank}: rel err {worst:.2e} > {bound:g}: {got} vs {want}")
    want_calls, most = LAYERS * r["forwards"], -(-r["max_len"] // world)
    longest = max(r["lengths"], default=0)
    if r["calls"] != want_calls:
        failures.append(f"{name}, rank {rank}: {r['calls']} attention forwards, want {want_calls}")
    if longest > most:
        failures.append(f"{name}, rank {rank}: a layer saw {longest} tokens, more than ceil(N / P) = {most}")


@pytest.mark.parametrize("world", [2, 3])
def test_clients_match_one_process(world, reference):
    table = _table()
    assert set(table) == set(CLIENTS), f"README client table rows {sorted(set(table) ^ set(CLIENTS))}"
    results = run_distributed(worker, world, True)
    assert all(isinstance(r, dict) for r in results), "\n".join(r[0] for r in results if isinstance(r, list))
    failures = [f for r in results for f in r.pop("gather_sequence")]
    for name, (status, cell) in table.items():
        if name not in results[0]:  # left out by LIGHTSEQ_TEST_CLIENTS (debugging)
            continue
        if status == "refused":
            quoted = re.search(r"`([^`]+)`", cell).group(1)
            for rank, r in enumerate(results):
                if quoted not in r[name].get("error", ""):
                    failures.append(f"{name}, rank {rank}: want an error with {quoted!r}, got {r[name]}")
        elif "error" in reference[name]:
            failures.append(f"{name}: the one-process reference failed: {reference[name]['error']}")
        else:
            bound = float(re.search(r"≤ ?([0-9.e-]+)", cell).group(1))
            for rank, r in enumerate(results):
                _compare(name, world, rank, r[name], reference[name], bound, failures)
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- one process, no distributed


def test_single_process_boundary(caplog):
    """The decoder stack called directly, right padding, the KV cache, and the logged attention switch."""
    import logging

    from tiny_models import loss_and_grads, make_batch

    import lightseq_hf

    ids, labels = make_batch(2, 21, seed=4)
    mask = torch.ones_like(ids)
    mask[1, -5:] = 0
    labels[1, -5:] = -100
    ref = _model()
    ref_loss, ref_grads, _ = loss_and_grads(ref, input_ids=ids, labels=labels, attention_mask=mask)
    ref.eval()
    with torch.no_grad():
        ref_hidden = ref.model(input_ids=ids).last_hidden_state
        ref_cache = ref(input_ids=ids[:, :-1], use_cache=True)
        ref_step = _decode_step(ref, ids[:, -1:], ref_cache)
    try:
        lightseq_hf.patch_llama()
        model = _model()
        with caplog.at_level(logging.WARNING, logger="lightseq_hf"):
            loss, grads, _ = loss_and_grads(model, input_ids=ids, labels=labels, attention_mask=mask)
        assert "attention implementation 'eager' -> 'lightseq_dist'" in caplog.text
        assert rel_err(loss, ref_loss) <= 1e-6  # right padding is exact
        assert max(rel_err(grads[n], ref_grads[n]) for n in ref_grads) <= 1e-5
        model.eval()
        with torch.no_grad():
            assert rel_err(model.model(input_ids=ids).last_hidden_state, ref_hidden) <= 1e-6
            cache = model(input_ids=ids[:, :-1], use_cache=True)
            assert _cache_of(cache) is not None and rel_err(cache.logits, ref_cache.logits) <= 1e-6
            step = _decode_step(model, ids[:, -1:], cache)
            assert rel_err(step.logits, ref_step.logits) <= 1e-6
            assert model(input_ids=ids, logits_to_keep=1).logits.shape == (2, 1, 128)
        with pytest.raises(ValueError, match="lightseq_logits='rows': choose 'full'"):
            model(input_ids=ids, lightseq_logits="rows")
    finally:
        lightseq_hf.unpatch_llama()
    assert model.config._attn_implementation == "eager"
