"""Tiny random fp32 Llama-family models and full-sequence references for the patch tests."""

from __future__ import annotations

import torch

VOCAB = 128


def make_model(arch: str = "llama", *, layers: int = 2, seed: int = 0, **overrides):
    """A tiny fp32 causal LM with GQA (4 query heads, 2 key/value heads), hidden 64, vocab 128."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  attn_implementation="eager")
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(sliding_window=None, **common)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(use_sliding_window=False, **common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, use_sliding_window=False, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return cls(config).float()


def make_batch(batch: int, seq: int, seed: int, *, ignore_prefix: int = 0):
    """Random input_ids and labels (= input_ids, the first ``ignore_prefix`` tokens of each row -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    labels[:, :ignore_prefix] = -100
    return ids, labels


def loss_and_grads(model, **inputs):
    """(loss, {name: grad}, logits) of one forward/backward in training mode."""
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, out.logits
