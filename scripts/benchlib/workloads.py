"""Inputs of the benchmarks: document-length mixes and the Llama model shapes of the step benchmarks."""

from __future__ import annotations

import math

import torch

SHAPES = {  # name: (hidden, intermediate, layers, heads, kv_heads, vocab)
    "7b": (4096, 11008, 32, 32, 32, 32000),  # Llama-2-7B
    "8b": (4096, 14336, 32, 32, 8, 128256),  # Llama-3.1-8B (GQA, its vocabulary)
    "7b-gqa": (4096, 11008, 32, 32, 8, 32000),
    "7b-33h": (4224, 11008, 32, 33, 33, 32000),  # the paper's irregular LLaMA-33H (head dim 128)
    "tiny": (64, 128, 2, 4, 2, 128),
}


def lognormal_docs(
    total: int, *, median: int, sigma: float, max_len: int, seed: int
) -> tuple[tuple[int, int], ...]:
    """Documents ``[start, stop)`` filling ``total`` tokens, lengths log-normal (``median``, ``sigma``)
    clipped to ``[1, max_len]``; the last document is cut at the row end. Deterministic in ``seed``."""
    g = torch.Generator().manual_seed(seed)
    docs, t = [], 0
    while t < total:
        length = math.exp(math.log(median) + sigma * float(torch.randn(1, generator=g)))
        length = max(1, min(max_len, round(length)))
        docs.append((t, min(total, t + length)))
        t += length
    return tuple(docs)


def llama_config(shape: tuple[int, ...], max_len: int):
    """A ``LlamaConfig`` of ``shape`` (see :data:`SHAPES`): SDPA attention, no cache, positions up to
    ``max_len`` (at least 4096)."""
    from transformers import LlamaConfig

    hidden, inter, layers, heads, kv_heads, vocab = shape
    return LlamaConfig(
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, vocab_size=vocab,
        max_position_embeddings=max(max_len, 4096), attn_implementation="sdpa", use_cache=False,
    )


def build_model(shape: tuple[int, ...], max_len: int, device: torch.device):
    """A randomly initialised ``LlamaForCausalLM`` of ``shape`` on ``device`` (no download)."""
    from transformers import LlamaForCausalLM

    config = llama_config(shape, max_len)
    with device:
        model = LlamaForCausalLM(config)
    return model
