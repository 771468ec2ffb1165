"""Rematerialization-aware checkpointing on one process (the 2- and 3-process counts are in
test_patch_llama.py): routing through both enable methods, attention-forward counts, identical gradients."""

from __future__ import annotations

import warnings

import pytest
import torch


@pytest.fixture(autouse=True)
def _unpatch():
    yield
    import lightseq_hf

    lightseq_hf.unpatch_llama()


def _step(model, ids):
    from kernel_checks import OpCalls
    from tiny_models import loss_and_grads

    with OpCalls() as seen:
        loss, grads, _ = loss_and_grads(model, input_ids=ids, labels=ids)
    return loss, grads, seen.calls


def test_policy_saves_only_the_distributed_attention():
    from torch.utils.checkpoint import CheckpointPolicy

    from lightseq_hf.checkpoint import remat_policy

    assert remat_policy(None, torch.ops.lightseq_hf.dist_attn_fwd.default) is CheckpointPolicy.MUST_SAVE
    others = (torch.ops.aten.mm.default, torch.ops.aten.mul.Tensor,
              torch.ops.lightseq_hf.dist_attn_bwd.default)
    for op in others:
        assert remat_policy(None, op) is CheckpointPolicy.PREFER_RECOMPUTE


def test_remat_checkpoint_runs_attention_once():
    from kernel_checks import OpCalls

    import lightseq_hf
    from lightseq_hf.checkpoint import remat_checkpoint

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g, requires_grad=True) for _ in range(3))

    def block(q, k, v):
        return (lightseq_hf.dist_flash_attn(q.sin(), k, v) * 2).exp().sum()

    plain = torch.autograd.grad(block(q, k, v), (q, k, v))
    with OpCalls() as seen:
        remat = torch.autograd.grad(remat_checkpoint(block, q, k, v), (q, k, v))
    assert seen.calls == {"forward": 1, "backward": 1}
    with OpCalls() as seen:
        torch.autograd.grad(torch.utils.checkpoint.checkpoint(block, q, k, v, use_reentrant=False), (q, k, v))
    assert seen.calls == {"forward": 2, "backward": 1}
    for a, b in zip(plain, remat):
        assert torch.equal(a, b)


@pytest.mark.parametrize("enable", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_enable_methods_route_to_remat(enable):
    from tiny_models import make_batch, make_model

    import lightseq_hf

    layers = 3
    ids, _ = make_batch(2, 40, seed=1)
    lightseq_hf.patch_llama()  # classes first: the model is built afterwards
    model = make_model("llama", layers=layers)
    loss0, grads0, calls0 = _step(model, ids)
    assert calls0 == {"forward": layers, "backward": layers}
    if not hasattr(model, enable):
        pytest.skip(f"this transformers has no {enable}")
    with warnings.catch_warnings():  # gradient_checkpointing_enable is deprecated from transformers 5.2x
        warnings.simplefilter("ignore", FutureWarning)
        getattr(model, enable)()
    loss1, grads1, calls1 = _step(model, ids)
    assert calls1 == {"forward": layers, "backward": layers}  # once per layer per step
    assert torch.equal(loss0, loss1)
    for name, grad in grads0.items():
        assert torch.equal(grad, grads1[name]), name
    lightseq_hf.patch_llama(model, checkpointing="hf")  # HF's layer checkpointing, for comparison
    loss2, grads2, calls2 = _step(model, ids)
    assert calls2 == {"forward": 2 * layers, "backward": layers}
    for name, grad in grads0.items():
        assert torch.equal(grad, grads2[name]), name
    lightseq_hf.patch_llama(model, checkpointing="remat")
    assert _step(model, ids)[2] == {"forward": layers, "backward": layers}


def test_enabled_before_patching_and_unpatch_restores():
    from tiny_models import make_batch, make_model

    import lightseq_hf

    ids, _ = make_batch(1, 24, seed=2)
    model = make_model("qwen2")
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    hf_funcs = {n: m._gradient_checkpointing_func for n, m in model.named_modules()
                if hasattr(m, "_gradient_checkpointing_func")}
    lightseq_hf.patch_model(model)
    assert _step(model, ids)[2] == {"forward": 2, "backward": 2}
    lightseq_hf.unpatch_llama()
    for name, module in model.named_modules():
        if name in hf_funcs:
            assert module._gradient_checkpointing_func is hf_funcs[name]
    assert model.config._attn_implementation == "eager"
    assert _step(model, ids)[2] == {"forward": 0, "backward": 0}  # HF's own attention again



def test_offloading_checkpoint_function_keeps_remat():
    """A checkpoint function that keeps its saved tensors in host memory (what Transformers'
    ``activation_checkpointing_enable(offload=True)`` builds on GPUs) still gets the remat policy."""
    import functools

    from tiny_models import make_batch, make_model
    from torch.autograd.graph import save_on_cpu

    import lightseq_hf

    def offloading_checkpoint(function, *args, **kwargs):
        with save_on_cpu(pin_memory=False):  # HF pins; pinned memory needs an accelerator
            return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)

    ids, _ = make_batch(1, 32, seed=3)
    lightseq_hf.patch_llama()
    model = make_model("llama", layers=2)
    loss0, grads0, _ = _step(model, ids)
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    for module in layers:
        module._gradient_checkpointing_func = functools.partial(offloading_checkpoint, use_reentrant=True)
    lightseq_hf.patch_model(model)  # re-routes: non-reentrant, remat policy, the offload kept
    assert all(m._gradient_checkpointing_func.args[0].func is offloading_checkpoint for m in layers)
    loss1, grads1, calls = _step(model, ids)
    assert calls == {"forward": 2, "backward": 2}
    assert torch.equal(loss0, loss1)
    for name, grad in grads0.items():
        assert torch.equal(grad, grads1[name]), name


def test_second_backward_under_remat_is_one_line_and_hf_checkpointing_serves_it():
    """remat keeps each layer's attention output for one backward: a second backward through the same graph
    (``retain_graph=True``) is refused naming the fix; with ``checkpointing="hf"`` both backwards run and the
    summed gradients equal the unpatched model's with Hugging Face's checkpointing."""
    from tiny_models import make_batch, make_model

    import lightseq_hf

    ids, _ = make_batch(1, 24, seed=3)

    def twice(model):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    reference = twice(make_model("llama"))
    model = lightseq_hf.patch_model(make_model("llama"))
    model.gradient_checkpointing_enable()
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError) as refused:
        loss.backward()
    message = str(refused.value)
    assert "second backward" in message and "checkpointing='hf'" in message and "\n" not in message, message
    lightseq_hf.unpatch_llama()
    hf = twice(lightseq_hf.patch_model(make_model("llama"), checkpointing="hf"))
    for got, want in zip(hf, reference):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
