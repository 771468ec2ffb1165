"""bf16 on one GPU: a sliding-window model (Gemma 3), MoE models (Qwen3-MoE; gpt-oss, with attention sinks
and sliding layers) and an MLA model (DeepSeek-V3, value head dim below the query's), patched and run
through the distributed attention on a one-process group (the local Triton kernels), against the
unpatched model in float64 (float32 for the MoE models, whose grouped expert matmuls take no float64)
on the same GPU: the loss and every parameter's gradient are no further from
float64 than twice the unpatched model's own bf16 error, plus a floor.

Run on a machine with a CUDA GPU: ``python -m pytest -s tests/gpu/test_architectures_gpu.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tiny_models import make_tiny

import lightseq_hf

WIDTHS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
              head_dim=64, moe_intermediate_size=128, sliding_window=256, vocab_size=512,
              max_position_embeddings=4096)
MODELS = {
    "gemma3_text": dict(WIDTHS, query_pre_attn_scalar=64),
    "qwen3_moe": dict(WIDTHS),
    "gpt_oss": dict(WIDTHS),
    "deepseek_v3": dict({k: v for k, v in WIDTHS.items() if k != "head_dim"}, num_key_value_heads=4,
                        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, kv_lora_rank=64,
                        q_lora_rank=96),
}
TOKENS = 2048


@pytest.fixture(scope="module")
def one_process_group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _loss_and_grads(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().double(), grads


def _errors(loss, grads, ref_loss, ref_grads) -> tuple[float, float]:
    """Relative loss error and the worst gradient error (each measured against its tensor's norm)."""
    worst = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items()
                if g.norm() > 0)
    return float((loss - ref_loss).abs() / ref_loss.abs()), worst


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_bf16_patched_no_further_from_float64_than_unpatched(model_type, one_process_group):
    ids = torch.randint(3, WIDTHS["vocab_size"], (1, TOKENS), generator=torch.Generator().manual_seed(0))
    ids = ids.cuda()
    try:
        ref = make_tiny(model_type, dtype=torch.float64, attn="eager", **MODELS[model_type]).cuda().train()
        ref_loss, ref_grads = _loss_and_grads(ref, ids)
    except RuntimeError:  # grouped expert matmuls take no float64: float32 (no TF32) is the reference
        ref = make_tiny(model_type, dtype=torch.float32, attn="eager", **MODELS[model_type]).cuda().train()
        ref_loss, ref_grads = _loss_and_grads(ref, ids)
    plain = make_tiny(model_type, dtype=torch.bfloat16, attn="eager", **MODELS[model_type]).cuda().train()
    plain_err = _errors(*_loss_and_grads(plain, ids), ref_loss, ref_grads)
    patched = make_tiny(model_type, dtype=torch.bfloat16, attn="eager", **MODELS[model_type]).cuda().train()
    lightseq_hf.patch(patched, sp_group=one_process_group)
    try:
        patched_err = _errors(*_loss_and_grads(patched, ids), ref_loss, ref_grads)
    finally:
        lightseq_hf.unpatch()
    print(f"\n{model_type}: bf16 against float64, {TOKENS} tokens: loss {patched_err[0]:.2e} patched, "
          f"{plain_err[0]:.2e} unpatched; worst gradient {patched_err[1]:.2e} patched, "
          f"{plain_err[1]:.2e} unpatched")
    assert patched_err[0] <= 2 * plain_err[0] + 2e-3
    assert patched_err[1] <= 2 * plain_err[1] + 2e-2
