"""The loss under every wrapping a user gets from accelerate or the Trainer, on 2 gloo processes, in float64.

The sequence-parallel tiny Llama (both ranks one group) is wrapped the way accelerate's FSDP2 plugin
does it (accelerate's own ``fsdp2_prepare_model``: decoder layers, the embedding, and
``[final norm, lm_head]`` as their own units), FSDP2 with the head under the root only, FSDP2 with the
head on its own, FSDP1, DDP, and a LoRA-wrapped head. For each, three float64 AdamW steps give the losses
and gradients of the unpatched model on one process, and the fused loss is proven taken: the head ran
once per chunk of rows in forward and never in backward.
"""

from __future__ import annotations

import types

import pytest
import torch
from distributed import rel_err, run_distributed
from tiny_models import make_batch, make_model

STEPS, SEQ, LAYERS = 3, 30, 2
WRAPPINGS = ("accelerate_fsdp2", "fsdp2_root_head", "fsdp2_own_head", "fsdp1", "ddp", "lora_head_fsdp2")


def _lora(model):
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], lora_dropout=0.0,
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _wrap(model, how: str):
    from torch.distributed.fsdp import fully_shard

    if how == "accelerate_fsdp2":
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
        )
        accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin),
                                            mixed_precision="no", device=torch.device("cpu"),
                                            is_main_process=torch.distributed.get_rank() == 0)
        return fsdp2_prepare_model(accelerator, model)
    if how in ("fsdp2_root_head", "fsdp2_own_head", "lora_head_fsdp2"):
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in inner.model.layers:
            fully_shard(layer)
        if how == "fsdp2_own_head":
            fully_shard(inner.lm_head)
        fully_shard(model)
        return model
    if how == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=True)
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    raise ValueError(how)


def _full_grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            return {_clean(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[_clean(n)] = g.detach().clone()
    return grads


def _clean(name: str) -> str:
    for prefix in ("_fsdp_wrapped_module.", "module.", "base_model.model."):
        name = name.replace(prefix, "")
    return name


def _float64_loss(model, ids, labels):
    """The shifted mean cross entropy in float64 (Transformers' own loss computes in float32)."""
    logits = model(input_ids=ids).logits
    targets = labels[:, 1:].reshape(-1)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(targets.numel(), -1), targets,
                                             ignore_index=-100)


def _run(model, steps, reference: bool = False):
    """Per-step (loss, grads) of AdamW steps on fixed float64 batches."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    results = []
    for step in range(steps):
        ids, labels = make_batch(2, SEQ, seed=100 + step, ignore_prefix=3)
        opt.zero_grad(set_to_none=True)
        loss = _float64_loss(model, ids, labels) if reference else model(input_ids=ids, labels=labels).loss
        loss.backward()
        results.append((loss.detach().clone(), _full_grads(model)))
        opt.step()
    return results


def _reference(how: str):
    # sdpa: eager attention takes its softmax in float32
    model = make_model("llama", layers=LAYERS, seed=5, _attn_implementation="sdpa").double()
    if how == "lora_head_fsdp2":
        model = _lora(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _run(model, STEPS, reference=True)


def _check_wrapping(how: str) -> list[str]:
    import lightseq_hf
    from lightseq_hf.parallel import ops
    from lightseq_hf.patches import forward

    ref = _reference(how)  # before patching: the unpatched model on this process alone
    model = make_model("llama", layers=LAYERS, seed=5).double()
    if how == "lora_head_fsdp2":
        model = _lora(model)
    lightseq_hf.patch_model(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    head = model.get_output_embeddings()
    head = getattr(head, "base_layer", head)  # LoRA's layer computes through the plain Linear it wraps
    model = _wrap(model, how)

    seen = {"head_rows": [], "attention": []}
    original_linear, original_attention = torch.nn.Linear.forward, ops.dist_attn_forward

    def recording_linear(self, x, *args, **kwargs):
        if self is head:
            seen["head_rows"].append(x.numel() // x.shape[-1])
        return original_linear(self, x, *args, **kwargs)

    def recording_attention(q, *args, **kwargs):
        seen["attention"].append(q.shape[1])
        return original_attention(q, *args, **kwargs)

    chunk, original_chunk = 8, forward.LOSS_CHUNK_TOKENS
    torch.nn.Linear.forward, ops.dist_attn_forward, forward.LOSS_CHUNK_TOKENS = (
        recording_linear, recording_attention, chunk)
    try:
        got = _run(model, STEPS)
    finally:
        torch.nn.Linear.forward, ops.dist_attn_forward, forward.LOSS_CHUNK_TOKENS = (
            original_linear, original_attention, original_chunk)
        lightseq_hf.unpatch_llama()
    failures = []
    # the fused loss: the head ran on one row (its width) and then on chunks of the slice's rows, in
    # forward only (backward reads no weight): never on the whole slice, never again in backward
    rows = 2 * (SEQ // 2)
    if seen["head_rows"] != ([1] + [min(chunk, rows - i) for i in range(0, rows, chunk)]) * STEPS:
        failures.append(f"{how}: the output head ran on {seen['head_rows']} rows ({rows} per step)")
    # the split: every layer's attention saw half the sequence, once per step (remat: no recompute)
    if seen["attention"] != [SEQ // 2] * (LAYERS * STEPS):
        failures.append(f"{how}: distributed attention calls saw local lengths {seen['attention']}")
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, ref)):
        if rel_err(loss, ref_loss) > 1e-10:
            failures.append(f"{how} step {step}: loss {loss.item()} vs {ref_loss.item()}")
        if set(grads) != set(ref_grads):
            failures.append(f"{how} step {step}: gradients of {sorted(set(grads) ^ set(ref_grads))} differ")
            continue
        worst = max((rel_err(grads[n], ref_grads[n]), n) for n in ref_grads)
        if worst[0] > 1e-8:
            failures.append(f"{how} step {step}: gradient of {worst[1]} off by {worst[0]:.2e}")
    return failures


def _worker(rank, world):
    failures = []
    for how in WRAPPINGS:
        try:
            failures += _check_wrapping(how)
        except Exception as exc:  # keep going: the peer runs the same wrappings in the same order
            failures.append(f"{how} raised {type(exc).__name__}: {exc}")
    return failures


def test_loss_under_every_wrapping():
    """One spawned pair runs all wrappings (a spawn costs seconds of imports)."""
    results = run_distributed(_worker, 2)
    assert results == [[], []]


def test_fused_loss_never_reads_the_head_in_backward():
    """A head whose weight is freed after the forward (as FSDP re-shards it) still gets exact gradients."""
    from lightseq_hf.parallel import fused_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 11, 8, generator=g, requires_grad=True)
    head = torch.nn.Linear(8, 13, bias=True)
    target = torch.randint(0, 13, (2, 11), generator=g)
    target[0, :4] = -100
    full = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), target.flatten(), reduction="sum")
    ref = torch.autograd.grad(full, [hidden, head.weight, head.bias])
    chunked = fused_loss.chunked_loss_sum(hidden, target, head, 13, chunk_size=6)
    saved = head.weight.data.clone()
    head.weight.data = torch.full_like(saved, float("nan"))  # a read in backward would poison the grads
    got = torch.autograd.grad(chunked, [hidden, head.weight, head.bias])
    assert rel_err(chunked, full) <= 1e-6
    assert max(rel_err(a, b) for a, b in zip(got, ref)) <= 1e-6
    with pytest.raises(ValueError, match="vocab_size is 12"):
        fused_loss.chunked_loss_sum(hidden, target, head, 12)
