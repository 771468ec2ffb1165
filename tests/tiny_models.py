"""Tiny random fp32 causal LMs and full-sequence references for the patch tests.

:func:`make_model` builds the Llama family the older tests use; :func:`tiny_config` shrinks the
config of any model type Transformers has (its defaults, with every size field that the config
class has set small: 3 layers, 6 query heads over 2 key/value heads, 4 experts, windows and
attention chunks of a few tokens) for the architecture tests.
"""

from __future__ import annotations

import torch

VOCAB = 128

#: size fields set on any config class that has them
SHRINK = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=6,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=256, sliding_window=5, attention_chunk_size=6,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=40, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, output_router_logits=True, router_aux_loss_coef=0.05,
    attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    residual_dropout=0.0, dropout=0.0, router_jitter_noise=0.0, input_jitter_noise=0.0,
    n_embd=48, n_layer=3, n_head=6, n_positions=256, n_inner=64, tie_word_embeddings=False,
)
#: per model type: fields to leave alone (derived by the config) and fields to set besides SHRINK
ADJUST = {
    "deepseek_v2": ({"head_dim"}, dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
                                       qk_nope_head_dim=8, v_head_dim=6, num_key_value_heads=6)),
    "deepseek_v3": ({"head_dim"}, dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
                                       qk_nope_head_dim=8, v_head_dim=6, num_key_value_heads=6)),
    "gpt_oss": (set(), dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma2": (set(), dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           final_logit_softcapping=3.0)),
    "gemma3_text": (set(), dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                query_pre_attn_scalar=10)),
    "cohere2": (set(), dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            logit_scale=0.5)),
    "cohere": (set(), dict(logit_scale=0.5)),
    "granite": (set(), dict(logits_scaling=3.0, attention_multiplier=0.2, embedding_multiplier=2.0,
                            residual_multiplier=0.5)),
    "qwen2": (set(), dict(use_sliding_window=True, max_window_layers=1,
                          layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
    "ministral": (set(), dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "llama4_text": (set(), dict(no_rope_layers=[1, 0, 1], attn_temperature_tuning=False,
                                layer_types=["chunked_attention", "full_attention", "chunked_attention"],
                                interleave_moe_layer_step=1, num_local_experts=2, num_experts_per_tok=1,
                                intermediate_size_mlp=64)),
    "phi3": (set(), dict(partial_rotary_factor=0.5)),
    "lfm2": (set(), dict(layer_types=["conv", "full_attention", "conv"])),
    "hunyuan_v1_moe": (set(), dict(moe_topk=2)),
    "granitemoehybrid": (set(), dict(mamba_n_heads=8, mamba_d_head=12, mamba_d_state=16)),
    "bamba": (set(), dict(mamba_n_heads=8, mamba_d_head=12, mamba_d_state=16)),
    "zamba2": (set(), dict(n_mamba_heads=8, mamba_headdim=12, mamba_d_state=16,
                           layers_block_type=["mamba", "hybrid", "mamba"])),
    "minicpm3": ({"head_dim"}, dict(num_key_value_heads=6, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                    v_head_dim=8, kv_lora_rank=16, q_lora_rank=24)),
    "gemma4_text": (set(), dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8)),
    "olmo2": (set(), {}),
}


def tiny_config(model_type: str, **overrides):
    """A tiny config of ``model_type``: its defaults with the fields of SHRINK and ADJUST it has set."""
    import transformers

    cls = transformers.CONFIG_MAPPING[model_type]
    fields = cls().to_dict()
    keep, extra = ADJUST.get(model_type, (set(), {}))
    values = {k: v for k, v in SHRINK.items() if k in fields and k not in keep}
    values.update(extra)
    values.update(overrides)
    layers = values.get("num_hidden_layers")
    kinds = fields.get("layer_types")
    if kinds and layers and "layer_types" not in values and len(kinds) != layers:
        values["layer_types"] = (list(dict.fromkeys(kinds)) * layers)[:layers]  # every kind it has, in turn
    return cls(**values)


def causal_lm_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def make_tiny(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, attn: str = "eager",
              **overrides):
    """A tiny random causal LM of ``model_type`` (see :func:`tiny_config`)."""
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return causal_lm_class(model_type)(config).to(dtype)


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
