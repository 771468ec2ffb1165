"""Model FLOPs, accelerator peaks, MFU and memory: the one place the trainer and the benchmarks count them.

* :func:`model_flops_per_step` — training FLOPs of one step (forward + backward, no recompute):
  ``6 * params * tokens`` for the matrix multiplies plus causal attention, whose visible query-key
  pairs are whole causal rows or, for packed documents, :func:`packed_attention_pairs`.
* :func:`flop_params` / :func:`matmul_params` — the parameters a token multiplies by (from a model or
  from a Llama-style config): everything but the input embedding table, the output head included even
  when it is tied to that table.
* :data:`PEAK_BF16_TFLOPS`, :func:`peak_tflops`, :func:`mfu` — datasheet dense bf16 peaks per GPU kind
  and model FLOPs utilization.
* :func:`memory_stats`, :func:`reset_peak_memory` — the device allocator's peak and current bytes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "PEAK_BF16_TFLOPS", "causal_attention_pairs", "flop_params", "matmul_params", "memory_stats", "mfu",
    "model_flops_per_step", "packed_attention_pairs", "peak_tflops", "reset_peak_memory", "tflops_per_device",
]

_GIB = 2**30

# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) from the vendor datasheets; the first key found in
# torch.cuda.get_device_name() wins, so longer names come before their prefixes.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "GB200": 2500.0, "B200": 2250.0, "H200": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "H800": 989.0,
    "A100": 312.0, "A800": 312.0, "L40S": 362.0,
}


def _head_dim(model_cfg: Any) -> int:
    return getattr(model_cfg, "head_dim", None) or model_cfg.hidden_size // model_cfg.num_attention_heads


def matmul_params(model_cfg: Any) -> int:
    """Weights of a Llama-style config's matrix multiplies: q/k/v/o projections and a gated MLP per
    layer, plus the output head (norms and the input embedding table excluded)."""
    hidden, heads = model_cfg.hidden_size, model_cfg.num_attention_heads
    kv_heads = getattr(model_cfg, "num_key_value_heads", None) or heads
    d = _head_dim(model_cfg)
    attention = 2 * hidden * heads * d + 2 * hidden * kv_heads * d
    mlp = 3 * hidden * model_cfg.intermediate_size
    return model_cfg.num_hidden_layers * (attention + mlp) + hidden * model_cfg.vocab_size


def flop_params(model: torch.nn.Module) -> int:
    """Weights of ``model``'s matrix multiplies: its matrices but the input embedding table, with the
    output head counted even when it shares that table (tied embeddings); for a Llama model this is
    :func:`matmul_params` of its config."""
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = {id(inp.weight)} if inp is not None else set()
    n = sum(p.numel() for p in model.parameters() if p.ndim >= 2 and id(p) not in skip)
    if out is not None and inp is not None and out.weight is inp.weight:
        n += out.weight.numel()
    return n


def causal_attention_pairs(seqs: int, seq_len: int) -> float:
    """Visible query-key pairs of ``seqs`` whole causal sequences (the ``N^2 / 2`` convention)."""
    return seqs * seq_len**2 / 2


def packed_attention_pairs(position_ids: torch.Tensor) -> int:
    """Visible causal pairs of rows whose ``position_ids`` restart at 0 for each document: a document
    of ``L`` tokens has ``L (L + 1) / 2``, the sum of ``position + 1`` over its tokens."""
    return int((position_ids.long() + 1).sum())


def model_flops_per_step(model_cfg: Any, n_params: int, seqs: int, seq_len: int,
                         attention_pairs: float | None = None) -> float:
    """Model FLOPs of one training step (no recompute): ``6 * n_params * tokens`` + causal attention.

    Attention costs ``4 * H * D`` forward FLOPs per visible pair and layer (scores and values), forward
    plus backward 3.5x that. ``attention_pairs``: the step's visible pairs when they are not whole
    causal sequences (packed documents); default :func:`causal_attention_pairs`.
    """
    pairs = causal_attention_pairs(seqs, seq_len) if attention_pairs is None else attention_pairs
    per_pair = 4 * model_cfg.num_attention_heads * _head_dim(model_cfg) * model_cfg.num_hidden_layers
    attn = 3.5 * per_pair * pairs
    return 6.0 * n_params * seqs * seq_len + attn


def peak_tflops(device: torch.device | str, override: float | None = None) -> float | None:
    """Dense bf16 peak TFLOP/s of ``device`` (``override`` when given; None for the CPU or an unlisted
    GPU)."""
    if override is not None:
        return override
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def tflops_per_device(flops: float, seconds: float, world: int) -> float:
    """Achieved model TFLOP/s per device of ``world`` devices sharing ``flops`` over ``seconds``."""
    return flops / seconds / world / 1e12


def mfu(flops: float, seconds: float, world: int, peak: float | None) -> float | None:
    """Model FLOPs utilization: achieved TFLOP/s per device over ``peak`` TFLOP/s (None without a peak)."""
    return tflops_per_device(flops, seconds, world) / peak if peak else None


def reset_peak_memory(device: torch.device | str) -> None:
    """Start a new peak window of the device allocator (nothing to do off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_stats(device: torch.device | str) -> dict[str, float]:
    """The CUDA allocator's peak and current allocated and reserved bytes (GiB) since the last
    :func:`reset_peak_memory`; empty off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {
        "peak_allocated_gib": s.get("allocated_bytes.all.peak", 0) / _GIB,
        "peak_reserved_gib": s.get("reserved_bytes.all.peak", 0) / _GIB,
        "allocated_gib": s.get("allocated_bytes.all.current", 0) / _GIB,
        "reserved_gib": s.get("reserved_bytes.all.current", 0) / _GIB,
    }
